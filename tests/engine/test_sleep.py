"""Sleep mode's ordering (a GPU feature, so the engine here is a recording stand-in: pure logic)."""

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from colograd import GRPOConfig
from colograd.engine import cpu as engine_cpu
from colograd.engine import launch as engine_launch
from colograd.engine.core import Engine
from colograd.engine.lifetime import layer_refs
from colograd.engine.requests import Sampling
from colograd.engine.settings import KV_CACHE_ONLY, engine_settings
from colograd.models import tiny
from colograd.trainer import GRPOTrainer


class RecordingLLM:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.asleep = False
        self.llm_engine = SimpleNamespace(is_sleeping=lambda: self.asleep)

    def wake_up(self, tags: list[str]) -> None:
        self.log.append("wake_up:" + ",".join(tags))
        self.asleep = False

    def sleep(self, level: int) -> None:
        self.log.append(f"sleep:{level}")
        self.asleep = True

    def release_kv_cache_memory(self) -> None:
        self.log.append("release_kv_cache_memory")

    def collective_rpc(self, method, args=()) -> list:
        self.log.append(method.__name__)
        return [self.packed_layers if method is engine_cpu.release_packed_weights else 0]

    packed_layers = 0  # layers whose packed weights the stand-in's worker would drop

    def reset_prefix_cache(self) -> None:
        self.log.append("reset_prefix_cache")


def engine_with(sleep_level: int, log: list[str]) -> Engine:
    engine = Engine.__new__(Engine)  # no vLLM: only the ordering logic is under test
    engine.llm, engine.sleep_level, engine.stale = RecordingLLM(log), sleep_level, False
    engine.weights_resident = sleep_level in (0, KV_CACHE_ONLY)  # as `Engine.__init__` leaves it, asleep
    engine.direct_load, engine.prepacked_experts, engine.packed_released = True, False, False  # a sync copies in
    engine.lora_request = None
    engine.heap_returned = False
    return engine


@pytest.mark.parametrize("level", [1, 2])
def test_weights_are_written_after_waking_and_before_the_kv_cache(level):
    """A rollout as the trainer runs it (`sync_for_rollout`, then `awake`): weights memory, the write, KV cache."""
    log: list[str] = []
    engine = engine_with(level, log)
    trainer = SimpleNamespace(engine=engine, sync_weights=lambda: log.append("sync"))
    GRPOTrainer.sync_for_rollout(trainer)
    with engine.awake():
        log.append("generate")
    assert log == ["wake_up:weights", "sync", "wake_up:kv_cache", "generate", f"sleep:{level}"]
    # Level 2 discards the weights: the next rollout must sync even if the optimizer did not step.
    assert engine.stale is (level == 2)


@pytest.mark.parametrize("level", [1, 2])
def test_a_rollouts_sync_phase_wakes_only_the_weights_and_its_generation_only_the_kv_cache(level):
    """The step's first phase (`make_rollout`): the weights memory back (`wake_weights`), the sync, then the prompts
    are prepared; the generation's `awake` brings back only the KV cache and writes nothing: a rollout syncs once.
    vLLM sees the calls of a wake in one piece: weights, the write, the KV cache. Level 2 drops the weights: the
    next rollout's `awake` refuses an engine nobody wrote again."""
    log: list[str] = []
    engine = engine_with(level, log)
    engine.wake_weights()
    log.append("sync")
    log.append("prepare_prompts")
    with engine.awake():
        log.append("generate")
    assert log == ["wake_up:weights", "sync", "prepare_prompts", "wake_up:kv_cache", "generate", f"sleep:{level}"]
    assert not engine.weights_resident and engine.stale is (level == 2)
    if level == 2:
        with pytest.raises(RuntimeError, match="does not hold the trainer's weights"), engine.awake():
            pass


def test_an_adapter_only_engine_keeps_its_base_in_place_and_releases_only_its_kv_cache(tmp_path):
    """An adapter-only LoRA engine's frozen base never changes: by default it sleeps at `KV_CACHE_ONLY` (vLLM's
    level-0 pause, then its KV cache's memory), so the base is neither copied to the host and back (level 1) nor
    dropped (level 2), and the adapter can be written while the engine sleeps."""
    args = GRPOConfig(output_dir=str(tmp_path), vllm_enable_sleep_mode=True, report_to="none")
    model, tokenizer = tiny.build_model(), tiny.build_tokenizer()
    assert engine_settings(model, tokenizer, args, lora_rank=8)["sleep_level"] == KV_CACHE_ONLY
    assert engine_settings(model, tokenizer, args)["sleep_level"] == 2
    log: list[str] = []
    engine = engine_with(KV_CACHE_ONLY, log)
    engine._sleep()  # as a new engine does
    assert engine.weights_resident and engine.sleeping
    engine.wake_weights()  # (nothing: the base stays in place)
    log.append("sync")
    with engine.awake():
        log.append("generate")
    assert log == ["sleep:0", "release_kv_cache_memory", "sync", "wake_up:kv_cache", "generate", "sleep:0",
                   "release_kv_cache_memory"]  # fmt: skip
    assert engine.weights_resident and not engine.stale


class StartingLLM(RecordingLLM):
    """Stands in for `vllm.LLM` while an `Engine` is built: records the start, then sleeps and wakes."""

    def __init__(self, log: list[str], **kwargs) -> None:
        super().__init__(log)
        log.append("start")
        cache = SimpleNamespace(num_gpu_blocks=4, block_size=16)
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=kwargs["max_model_len"]),
            vllm_config=SimpleNamespace(cache_config=cache),
        )

    def collective_rpc(self, method, args=()) -> list:
        if method is engine_cpu.release_kv_cache:
            return super().collective_rpc(method, args)
        lists = (layer_refs, engine_launch._raise_to_engine_precision)  # no layers, no tensor raised
        return [[]] if method in lists else [True]  # a worker that holds plain weights


@pytest.mark.parametrize("sleep_mode", [True, False], ids=["sleep-mode", "no-sleep-mode"])
def test_engine_sleeps_as_soon_as_it_is_built(sleep_mode, tmp_path, monkeypatch):
    """With sleep mode the engine's memory is free from the start (while DeepSpeed / FSDP set up the model),
    and the first rollout wakes it."""
    import vllm

    log: list[str] = []
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: StartingLLM(log, **kwargs))
    args = GRPOConfig(output_dir=str(tmp_path), max_prompt_length=16, max_completion_length=8,
                      vllm_enable_sleep_mode=sleep_mode, report_to="none")  # fmt: skip
    engine = Engine(tiny.build_model(), tiny.build_tokenizer(), args)
    assert log == (["start", "sleep:2"] if sleep_mode else ["start"])
    engine.wake_weights()
    log.append("sync")
    engine.stale = False  # (as the write leaves it)
    with engine.awake():
        log.append("generate")
    expected = (
        ["wake_up:weights", "sync", "wake_up:kv_cache", "generate", "sleep:2"]
        if sleep_mode
        else ["sync", "generate", *AFTER_A_CPU_ROLLOUT]
    )
    assert log[-len(expected) :] == expected


def test_engine_sleeps_even_if_generation_fails():
    log: list[str] = []
    engine = engine_with(2, log)
    with pytest.raises(RuntimeError), engine.awake():
        raise RuntimeError("generation failed")
    assert log[-1] == "sleep:2"


# Without a GPU (vLLM's sleep mode is CUDA-only), what an engine releases after each rollout: its KV cache's pages and
# the cached prefixes they held (`colograd.engine.cpu`).
AFTER_A_CPU_ROLLOUT = [] if torch.cuda.is_available() else ["release_kv_cache", "reset_prefix_cache"]


def test_without_sleep_mode_awake_on_a_cpu_releases_the_kv_cache_after_the_generation():
    log: list[str] = []
    engine = engine_with(0, log)
    log.append("sync")
    with engine.awake():
        log.append("generate")
    assert log == ["sync", "generate", *AFTER_A_CPU_ROLLOUT]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU engine does not rest on the host")
def test_on_a_cpu_the_free_heap_is_returned_after_the_first_rollout_only(monkeypatch):
    """The first rest returns the heap the engine's start-up freed; later ones keep what the last training step
    freed, which the next one allocates again (given back, each of its pages is faulted in again inside that step)."""
    log: list[str] = []
    monkeypatch.setattr(engine_cpu, "return_free_heap", lambda: log.append("return_free_heap"))
    engine = engine_with(0, log)
    for _ in range(3):
        with engine.awake():
            log.append("generate")
    assert log.count("return_free_heap") == 1
    assert log[: log.index("return_free_heap")] == ["generate", *AFTER_A_CPU_ROLLOUT]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU engine does not rest on the host")
def test_on_a_cpu_an_engine_whose_sync_repacks_releases_its_packed_weights_and_is_stale_until_the_next_sync():
    """Where a sync reloads (and packs again) every layer, the rollout's end drops the packed copies: the engine is
    stale, so the trainer's next sync writes it whole, and it refuses to generate until a load."""
    log: list[str] = []
    engine = engine_with(0, log)
    engine.direct_load, engine.llm.packed_layers = False, 3
    log.append("sync")
    with engine.awake():
        log.append("generate")
    assert log == ["sync", "generate", "release_kv_cache", "reset_prefix_cache", "release_packed_weights"]
    assert engine.stale and engine.packed_released
    with pytest.raises(RuntimeError, match="released its packed weights"):
        engine.generate([[1, 2]], Sampling.of(GRPOConfig(output_dir="unused", report_to="none")))
    engine._forget_image_features = lambda: None
    engine.weights_version = 0
    engine.load_weights([])  # (the stand-in's worker writes nothing)
    assert not (engine.stale or engine.packed_released)
    # An adapter-only engine keeps its frozen base packed: its syncs send the adapter alone.
    engine.lora_request = object()
    with engine.awake():
        pass
    assert not (engine.stale or engine.packed_released) and log[-1] == "reset_prefix_cache"


@pytest.mark.parametrize(
    "synced, stale, expect_sync",
    [(None, True, True), (3, False, False), (2, False, True), (3, True, True)],
    ids=["first", "same-step", "optimizer-stepped", "engine-dropped-weights"],
)
def test_the_engine_syncs_only_when_it_lacks_the_trainers_weights(synced, stale, expect_sync):
    """`Engine.sync(write, version)`: the trainer's weights of its optimizer step are written once, and again where
    the engine dropped them; the trainer's `sync_weights` is that call with its step."""
    written = []
    engine = engine_with(0, [])
    engine._synced_version, engine.stale = synced, stale
    engine.sync(lambda: written.append(True), 3)
    assert bool(written) is expect_sync and engine._synced_version == 3
    calls = []
    stand_in = SimpleNamespace(sync=lambda write, version: calls.append((write, version)))
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=3), _write_weights=lambda: None, engine=stand_in)
    GRPOTrainer.sync_weights(trainer)
    assert calls == [(trainer._write_weights, 3)]


@pytest.mark.parametrize("asleep", [True, False], ids=["asleep", "awake"])
def test_vllm_generation_sync_weights_wakes_a_sleeping_engine(asleep):
    """`trainer.vllm_generation.sync_weights()` (TRL's name, reachable from a callback between rollouts) never
    writes into a sleeping engine: it wakes it for the sync and puts it back to sleep; awake (inside a rollout,
    from a rollout_func) it only syncs."""
    from colograd.agents.core import VLLMGeneration

    log: list[str] = []
    engine = engine_with(2, log)
    engine.llm.asleep, engine.weights_resident = asleep, not asleep
    trainer = SimpleNamespace(engine=engine, args=GRPOConfig(output_dir="x"))
    trainer.sync_weights = lambda: engine.sync(lambda: log.append("sync"), 3)
    VLLMGeneration(trainer).sync_weights()
    assert log == (["wake_up:weights", "sync", "wake_up:kv_cache", "sleep:2"] if asleep else ["sync"])


def test_weights_are_never_written_into_an_asleep_engine():
    """Between rollouts with sleep mode on, the weights memory is released (level 2) or on the host (level 1): a
    write there is lost, or on a GPU lands in freed memory. `Engine.load_weights` and `load_adapter` refuse it in
    one line; inside `awake`'s sync they write."""
    log: list[str] = []
    engine = engine_with(2, log)
    engine.weights_resident = False  # as `Engine.__init__` leaves an engine with sleep mode on
    engine.direct_load, engine.prepacked_experts, engine.weights_version, engine.vision = True, False, 0, False
    engine.llm.collective_rpc = lambda *args, **kwargs: log.append("written")
    with pytest.raises(RuntimeError, match=r"Engine.load_weights: the engine is asleep.*trainer.sync_weights") as err:
        engine.load_weights([])
    assert "\n" not in str(err.value)
    with pytest.raises(RuntimeError, match="Engine.load_adapter: the engine is asleep"):
        engine.load_adapter({}, None)
    engine.wake_weights()
    engine.load_weights([])
    with engine.awake():
        pass
    assert log == ["wake_up:weights", "written", "wake_up:kv_cache", "sleep:2"] and engine.weights_version == 1
    with pytest.raises(RuntimeError, match="asleep"):  # asleep again after the rollout
        engine.load_weights([])


def test_a_sync_called_between_rollouts_wakes_the_engine_for_it():
    """`trainer.sync_weights()` from a callback between rollouts (sleep mode on): woken, synced, asleep again."""
    log: list[str] = []
    engine = engine_with(2, log)
    engine.weights_resident, engine.stale, engine._synced_version = False, True, 2
    trainer = SimpleNamespace(
        state=SimpleNamespace(global_step=3),
        engine=engine,
        weight_plan=SimpleNamespace(sync=lambda engine: log.append(f"sync:{engine.weights_resident}")),
        _timed=lambda phase: nullcontext(),
    )
    trainer._write_weights = lambda: GRPOTrainer._write_weights(trainer)
    GRPOTrainer.sync_weights(trainer)
    assert log == ["wake_up:weights", "sync:True", "wake_up:kv_cache", "sleep:2"] and engine._synced_version == 3
