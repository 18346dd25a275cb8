"""The parity guard (colograd/grpo/parity.py) through real runs: one family per class of engine/trainer disagreement,
each stopped before its first optimizer step when the class's fault is there, and trained exact once it is fixed.

Each test removes the fix (or injects the fault) and checks that the gate stops the run in one line, then checks that
the fixed run trains within the float32 tolerance, so that both the guard and the fix are needed for it to pass. The
models are zoo models (shrunk in width only, sharp weights: `zoo.stopping_model`); this file runs with the zoo, in a
process of its own (their vocabularies are real).
"""

import logging

import pytest
import torch
import zoo
from datasets import Dataset
from test_zoo import answer_length, chat_rows, rope_base_of_10k, step_log

from colograd import GRPOConfig, GRPOTrainer
from colograd.engine import fresh, sync
from colograd.engine import launch as engine_launch
from colograd.engine import weights as engine_weights
from colograd.engine.core import Engine
from colograd.grpo import parity, parity_diagnosis
from colograd.grpo.parity import ParityError

pytestmark = pytest.mark.slow


def trainer_for(
    name: str, tmp_path, max_steps: int = 1, dtype: torch.dtype = torch.float32, calibrated: bool = True, **settings
) -> GRPOTrainer:
    """TRL's quickstart settings with short completions, on `name`'s stopping model (in `dtype`); on its shrunk model
    as initialised (no sharpening, no calibration of its answers' length) where not `calibrated`, for a start-up that
    is refused before any rollout."""
    settings = {"save_strategy": "no", "vllm_enforce_eager": True, "max_completion_length": 64, **settings}
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=max_steps, report_to="none", **settings)
    if calibrated:
        model, tokenizer = zoo.stopping_model(name)
    else:
        from transformers import AutoModelForCausalLM

        config = zoo.shrunk(name)
        model, tokenizer = AutoModelForCausalLM.from_config(config), zoo.tokenizer_for(config)
    model.to(dtype)
    return GRPOTrainer(model=model, reward_funcs=answer_length, args=args,
                       train_dataset=Dataset.from_list(chat_rows() * 4), processing_class=tokenizer)  # fmt: skip


def stops_before_training(trainer: GRPOTrainer) -> str:
    """Train: the gate must stop the run at its first rollout, before any optimizer step. Returns the line: the
    engine and trainer disagree, or the engine computes NaN (a tensor a sync left out holds whatever memory the
    engine's reload gave it, which may make its model compute NaN)."""
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ParityError) as err:
        trainer.train()
    line = str(err.value)
    stopped = "engine and trainer disagree" in line or "the engine computes NaN" in line
    assert "\n" not in line and stopped and "before training" in line
    assert trainer.state.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # nothing trained
    return line


def trains_two_steps_exact(name: str, tmp_path) -> None:
    """Two steps of `trainer_for(name)` train, the sampling gap within the float32 bound."""
    trainer = trainer_for(name, tmp_path, max_steps=2)
    trainer.train()
    assert trainer.state.global_step == 2
    assert step_log(trainer)["sampling/sampling_logp_difference/max"] <= 1e-3


# Faults the fixes remove, injected.


def without_buffers(monkeypatch) -> None:
    """The sync as it was: parameters only."""
    monkeypatch.setattr(sync, "_persistent_buffers", lambda model: iter(()))


def reload_only(monkeypatch) -> None:
    """Every tensor through vLLM's in-place reload where the sync takes that path (as before `_reload_into_model`)."""
    monkeypatch.setattr(engine_weights, "split_unprocessed", lambda model, weights: ([], list(weights)))


def without_one_projection(monkeypatch) -> None:
    """The sync sends every weight but one repacked linear layer's (its kernel handle keeps the dummy weights)."""
    own = Engine.load_weights
    monkeypatch.setattr(Engine, "load_weights", lambda engine, weights: own(engine, [
        (name, tensor) for name, tensor in weights if name != "model.layers.0.self_attn.o_proj.weight"]))  # fmt: skip


def without_one_dt_bias(monkeypatch) -> None:
    """The sync sends every weight but one Gated DeltaNet layer's `dt_bias` (the engine keeps its dummy values)."""
    own = Engine.load_weights
    monkeypatch.setattr(Engine, "load_weights", lambda engine, weights: own(engine, [
        (name, tensor) for name, tensor in weights if name != "model.layers.0.linear_attn.dt_bias"]))  # fmt: skip


def test_a_routers_buffer_reaches_the_engine(tmp_path, monkeypatch):
    """GLM-4.5-Air's routers keep their score-correction bias in a persistent buffer. Sent with the parameters only,
    the engine routes by its dummy start-up values and samples from another model: the gate stops the run. With the
    buffers synced, the step is exact."""
    name = "zai-org/GLM-4.5-Air"
    with monkeypatch.context() as patched:
        without_buffers(patched)
        line = stops_before_training(trainer_for(name, tmp_path / "unsynced"))
    assert "Glm4MoeForCausalLM" in line
    # The diagnosis: a fresh engine loaded with the trainer's weights holds other router biases than this one.
    assert "A freshly loaded engine differs" in line and "colograd's sync leaves them stale" in line
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in line and parity.EITHER_CAUSE not in line
    trainer = trainer_for(name, tmp_path / "synced")
    trainer.train()
    assert step_log(trainer)["sampling/sampling_logp_difference/max"] <= 1e-3


def test_a_tensor_vllms_loader_never_writes_is_blamed_on_vllm_not_on_the_sync(tmp_path):
    """vLLM 0.32's Laguna registers its router's correction bias on its expert layer, where its loader never looks
    (a checkpoint's `mlp.experts.e_score_correction_bias` is passed over as an unexpected `_bias`): the engine routes
    by its start-up values whatever the sync sends. The gate stops the run, and the diagnosis finds the bias the only
    difference from a fresh load and left unwritten by vLLM's loader there too: vLLM's model, not colograd's sync.
    Laguna as transformers' default config gives it (`zoo.from_defaults`: no published config in the zoo)."""
    line = stops_before_training(trainer_for(zoo.from_defaults("laguna"), tmp_path))
    assert "LagunaForCausalLM" in line and "vLLM's loader never writes" in line
    assert "model.layers.1.mlp.experts.routed_experts.e_score_correction_bias" in line
    assert "vLLM's model is at fault, not colograd's sync" in line and "colograd's sync leaves" not in line


def test_a_buffer_transformers_renames_on_loading_reaches_the_engine_under_its_saved_name(tmp_path, monkeypatch):
    """EXAONE-MoE's routers keep their score-correction bias in a buffer that transformers loads from the checkpoint's
    `mlp.e_score_correction_bias` into `mlp.gate.e_score_correction_bias`; vLLM's model holds it under the saved name
    only. Asked under the trainer's name alone, the engine holds no such tensor and the sync leaves the bias out: the
    gate stops the run naming it. Sent under its saved name, two steps train exact. EXAONE-MoE as transformers'
    default config gives it (`zoo.from_defaults`: no published config in the zoo)."""
    name = zoo.from_defaults("exaone_moe")
    with monkeypatch.context() as patched:
        patched.setattr(sync.WeightPlan, "_held_under_saved_names", lambda plan, engine, buffers: set())
        line = stops_before_training(trainer_for(name, tmp_path / "unsent"))
    assert "ExaoneMoeForCausalLM" in line and "model.layers.1.mlp.e_score_correction_bias" in line
    trains_two_steps_exact(name, tmp_path / "sent")


def test_a_tensor_vllm_keeps_below_the_engines_precision_is_held_at_it(tmp_path, monkeypatch, caplog):
    """vLLM's xIELU activation (Apertus) makes its learned `alpha_p` / `alpha_n` and its constants in bfloat16
    whatever the engine's dtype, where transformers' float32 model holds them in float32: a sync rounds the trainer's
    values there, and the float32 engine samples 1e-3 nats from its trainer, past the gate's bound. Left so, the gate
    stops the run (a fresh engine, made the same way, agrees: vLLM's model computes another distribution); held at the
    engine's precision, two steps train exact. Apertus as transformers' default config gives it (`zoo.from_defaults`:
    no published config in the zoo)."""
    name = zoo.from_defaults("apertus")
    with monkeypatch.context() as patched:
        for module in (engine_weights, fresh):
            patched.setattr(module, "at_engine_precision", lambda model, dtype: [])
        line = stops_before_training(trainer_for(name, tmp_path / "rounded"))
    assert "ApertusForCausalLM" in line and "A freshly loaded engine agrees" in line
    with caplog.at_level(logging.WARNING):
        trains_two_steps_exact(name, tmp_path / "held")
    said = [r.getMessage() for r in caplog.records if "below the engine's" in r.getMessage()]
    assert len(said) == 1 and "ApertusForCausalLM keeps" in said[0] and "held at torch.float32" in said[0], said


def test_warn_trains_on_with_the_gap_logged(tmp_path, monkeypatch, caplog):
    """`engine_parity: warn` turns the gate's stop into a warning: the run trains, and logs the gap."""
    without_buffers(monkeypatch)
    trainer = trainer_for("zai-org/GLM-4.5-Air", tmp_path, engine_parity="warn")
    with caplog.at_level(logging.WARNING, logger=parity.__name__):
        trainer.train()
    assert trainer.state.global_step == 1
    assert any("engine and trainer disagree" in r.getMessage() for r in caplog.records)
    fp32 = parity.tolerance(torch.float32, torch.float32)
    assert step_log(trainer)["sampling/sampling_logp_difference/max"] > fp32.max


def test_the_running_guard_stops_a_divergence_mid_run_with_a_checkpoint(tmp_path, monkeypatch, caplog):
    """From the third rollout on, every sync writes the output layer scaled by 3 into the engine (a sync gone wrong
    mid-run). The guard warns once at that step and stops the run after `PERSISTENT` such rollouts, with a checkpoint
    of the step it stopped at; the steps before trained as usual."""
    name = "Qwen/Qwen3-0.6B"
    own = sync.WeightPlan.sync
    syncs = []

    def drifting(plan, engine):
        syncs.append(1)
        if len(syncs) < 3:
            return own(plan, engine)
        head = plan.model.get_output_embeddings().weight
        with torch.no_grad():
            head.mul_(3.0)
            try:
                return own(plan, engine)
            finally:
                head.div_(3.0)

    monkeypatch.setattr(sync.WeightPlan, "sync", drifting)
    args = {"save_strategy": "steps", "save_steps": 100}
    trainer = trainer_for(name, tmp_path, max_steps=10, **args)
    with caplog.at_level(logging.WARNING, logger=parity.__name__), pytest.raises(ParityError) as err:
        trainer.train()
    line = str(err.value)
    assert "\n" not in line and "stopped with a checkpoint" in line
    # The diagnosis: the engine's (tied) output layer is not the trainer's.
    assert "A freshly loaded engine differs" in line and "(model.embed_tokens.weight, lm_head.weight)" in line
    stopped = 2 + parity.PERSISTENT  # two good steps, then PERSISTENT diverged rollouts
    assert trainer.state.global_step == stopped
    assert (tmp_path / f"checkpoint-{stopped}").is_dir()
    warnings = [r.getMessage() for r in caplog.records if "engine and trainer disagree" in r.getMessage()]
    assert len(warnings) == 1 and "at step 3" in warnings[0]


SINKS = ["model.layers.0.attn.sinks", "model.layers.1.attn.sinks"]  # gpt-oss's, in the engine's naming


def sharp_sinks(model: torch.nn.Module) -> None:
    """Move gpt-oss's attention sinks by 2 (the zoo's sharpening moves vectors by 0.2): a sink that keeps its
    start-up values in the engine then moves each head's attention, and the gap, by far more than the tolerance."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".sinks"):
                param.add_(torch.randn(param.shape, generator=generator) * 2.0)


def test_attention_sinks_survive_the_engines_reload(tmp_path, monkeypatch):
    """gpt-oss's loader copies its attention sinks in itself; vLLM's in-place reload (the sync's path where the CPU
    backend repacks linear weights, its default) drops such writes, and the engine kept its start-up sinks. Without
    `_reload_into_model`'s direct copy of tensors nothing processes, the gate stops the run and names the sinks; with
    it, the step is exact."""
    name = "openai/gpt-oss-20b"
    with monkeypatch.context() as patched:
        reload_only(patched)
        trainer = trainer_for(name, tmp_path / "reloaded")
        sharp_sinks(trainer.model)
        line = stops_before_training(trainer)
    assert not trainer.engine.direct_dense  # the reload path
    assert "A freshly loaded engine differs" in line and "colograd's sync leaves them stale" in line
    assert ", ".join(SINKS) in line
    trainer = trainer_for(name, tmp_path / "copied")
    sharp_sinks(trainer.model)
    trainer.train()
    assert step_log(trainer)["sampling/sampling_logp_difference/max"] <= 1e-3


@pytest.mark.parametrize("dtype, worst", [(torch.float32, 1e-4), (torch.bfloat16, 1.0)], ids=["float32", "bf16"])
def test_latent_attention_trains_on_the_trainers_distribution(tmp_path, dtype, worst):
    """DeepSeek-V3's shape (MLA with a compressed query, grouped sigmoid routing with a score-correction bias) trains
    with the engine sampling the trainer's distribution: exact in float32, within a healthy bf16 run's worst token
    (`colograd.grpo.parity.tolerance`) in bf16. On a CPU with AMX tiles vLLM would serve latent attention with kernels
    that refuse float32 weights (the engine would not start) and that, in bf16, empty `kv_b_proj`'s weight, which the
    sync's reload then fails to copy back into (`colograd.engine.cpu.mla_backend`)."""
    trainer = trainer_for("deepseek-ai/DeepSeek-V3", tmp_path, dtype=dtype, bf16=dtype == torch.bfloat16)
    assert trainer.engine.settings["dtype"] == str(dtype).removeprefix("torch.")
    trainer.train()  # the parity gate (engine_parity: error) lets the first step train
    assert trainer.state.global_step == 1
    assert step_log(trainer)["sampling/sampling_logp_difference/max"] <= worst


def test_an_engine_whose_own_model_differs_is_said_so(tmp_path, monkeypatch):
    """vLLM's model computing otherwise than transformers' on the same weights, simulated by starting the engine with
    another rope base than the model's: every tensor the engine holds is what a fresh engine (of the same vLLM model)
    loads, so the line says the sync is complete and the engine's model differs, and what to try."""
    own = engine_launch.engine_config

    def mutated(model):
        config = own(model)
        rope_base_of_10k(config)
        return config

    monkeypatch.setattr(engine_launch, "engine_config", mutated)
    line = stops_before_training(trainer_for("Qwen/Qwen3-0.6B", tmp_path))
    assert "A freshly loaded engine agrees" in line and "so the sync is complete" in line
    assert "vLLM's Qwen3ForCausalLM and the trainer's forward compute different distributions" in line
    assert "differs:" not in line and parity.EITHER_CAUSE not in line


PHI_MOE = "microsoft/Phi-3.5-MoE-instruct"


def without_output_bias(trainer: GRPOTrainer) -> None:
    """Phi-3.5-MoE's output layer with its bias zero and frozen: vLLM 0.32's PhiMoEForCausalLM loads that bias but
    never adds it to its logits (`test_vllms_phi_moe_leaves_out_its_output_bias_and_the_gate_says_so`), so only then
    does its engine compute the trainer's distribution."""
    bias = trainer.model.lm_head.bias
    with torch.no_grad():
        bias.zero_()
    bias.requires_grad_(False)


def test_a_training_pass_that_samples_its_experts_trains_gated_on_its_evaluation_pass(tmp_path, monkeypatch, caplog):
    """Phi-3.5-MoE samples its experts in training (SparseMixer's Gumbel draw, after an input jitter) and takes the top
    ones in evaluation, as vLLM does: no engine samples the training pass's noise. Gated on the training pass, a
    healthy run stopped at its first rollout and blamed vLLM; gated on the evaluation pass it trains, with the running
    guard, which reads the training pass, off and said so once."""
    with monkeypatch.context() as patched:
        patched.setattr(parity.ParityGuard, "settled_logps", lambda guard, model, logps: None)  # the training pass
        trainer = trainer_for(PHI_MOE, tmp_path / "training-pass")
        without_output_bias(trainer)
        line = stops_before_training(trainer)
    assert "A freshly loaded engine agrees" in line  # every tensor right: the gate blamed vLLM's model
    trainer = trainer_for(PHI_MOE, tmp_path / "evaluation-pass", max_steps=3)
    without_output_bias(trainer)
    with caplog.at_level(logging.WARNING, logger=parity.__name__):
        trainer.train()
    assert trainer.state.global_step == 3 and not trainer.parity.running
    assert caplog.text.count("training pass differs from its evaluation pass") == 1
    assert "engine and trainer disagree" not in caplog.text


def test_vllms_phi_moe_leaves_out_its_output_bias_and_the_gate_says_so(tmp_path):
    """vLLM's own model differing from transformers', measured: vLLM 0.32's PhiMoEForCausalLM creates and loads the
    output layer's bias (`lm_head_bias: true` in Phi-3.5-MoE's config) but its `compute_logits` never adds it, where
    transformers' does (0.41 nats at worst over 58 prompt tokens of this model; 1e-5 with the bias zero). The engine
    holds every tensor a fresh engine loads, so the gate's line says the sync is complete and vLLM's model differs."""
    line = stops_before_training(trainer_for(PHI_MOE, tmp_path))
    assert "A freshly loaded engine agrees" in line and "so the sync is complete" in line
    assert "vLLM's PhiMoEForCausalLM and the trainer's forward compute different distributions" in line


# Models with each kind of tensor a sync must reach: a router's persistent buffer and experts (GLM-4.5-Air), attention
# sinks its loader copies in itself and biased experts (gpt-oss), a dense model, and hybrids' Gated DeltaNet layers
# (a prepacked convolution, A_log, dt_bias, gated norms; projections split in Qwen3.5, fused in Qwen3-Next, whose
# experts are prepacked too).
FRESH_MODELS = ["zai-org/GLM-4.5-Air", "openai/gpt-oss-20b", "Qwen/Qwen3-0.6B", "Qwen/Qwen3.5-4B",
                "Qwen/Qwen3-Next-80B-A3B-Instruct", "ibm-granite/granite-4.0-h-tiny"]  # fmt: skip


def engine_for(name: str, tmp_path, repack: bool) -> tuple[torch.nn.Module, Engine]:
    """`name`'s stopping model (sinks moved: `sharp_sinks`) and an engine for it, its weights still dummy values."""
    model, tokenizer = zoo.stopping_model(name)
    sharp_sinks(model)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8,
                      max_prompt_length=32, max_completion_length=8, vllm_kv_cache_gib=0.1, vllm_enforce_eager=True,
                      report_to="none", vllm_cpu_repack_weights=repack)  # fmt: skip
    return model, Engine(model, tokenizer, args)


def differences(engine: Engine, model: torch.nn.Module) -> tuple[list[str], int]:
    """The engine's tensors and layers that differ from a fresh load of `model`'s saved weights, and how many were
    compared. vLLM's loader writes every tensor of these models: none differs for being left unwritten."""
    weights = parity_diagnosis.saved_weights(model)
    differ, compared, unwritten = engine.llm.collective_rpc(fresh.differences_in_engine, args=(weights,))[0]
    assert unwritten == []
    return differ, compared


@pytest.mark.parametrize("repack", [True, False], ids=["repacked", "direct"])
@pytest.mark.parametrize("name", FRESH_MODELS)
def test_after_a_sync_the_engine_holds_what_a_fresh_engine_loads(name, repack, tmp_path):
    """After a sync, every tensor of the engine's model (and every linear layer whose weight the CPU backend moved
    into a kernel handle, by what it computes) equals that of a fresh engine loaded from the trainer's saved weights;
    again after every parameter and persistent buffer moved, as after an optimizer step. Before any sync (dummy
    weights) nearly all differ, so the comparison sees a stale tensor."""
    model, engine = engine_for(name, tmp_path, repack)
    # A hybrid's bf16 convolutions are prepacked whatever the setting, where the CPU has the kernel: their engine then
    # takes its dense weights by reload. Linear weights are packed where asked and vLLM can make the oneDNN handle.
    convolutions = engine.llm.collective_rpc(lambda w: engine_weights._prepacked_convolutions(w.model_runner.model))[0]
    packed = repack and zoo.cpu_packs_linear_weights(getattr(torch, engine.settings["dtype"]))
    assert engine.direct_dense is not (packed or bool(convolutions))
    hybrid_in_bf16 = name in zoo.HYBRIDS and engine.settings["dtype"] == "bfloat16"  # (Gated DeltaNet)
    assert bool(convolutions) is (hybrid_in_bf16 and zoo.cpu_prepacks_convolutions()), convolutions
    differ, compared = differences(engine, model)
    assert len(differ) >= compared // 2 > 10, (differ, compared)
    plan = sync.WeightPlan(model)
    plan.sync(engine)
    assert differences(engine, model) == ([], compared)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for tensor in [*model.parameters(), *(b for _, b in sync._persistent_buffers(model))]:
            if tensor.is_floating_point():
                tensor.add_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype) * 0.05)
    assert differences(engine, model)[0]  # moved, not yet synced
    plan.sync(engine)
    assert differences(engine, model) == ([], compared)


STALE = {  # the fault injected, the model, its linear weights repacked, the tensors a fresh load then finds stale
    "router buffer unsent": (without_buffers, "zai-org/GLM-4.5-Air", False,
                             ["model.layers.1.mlp.gate.e_score_correction_bias"]),
    "sinks lost by the reload": (reload_only, "openai/gpt-oss-20b", True, SINKS),
    # Its weight tensor is empty (moved into a oneDNN handle): found by what the layer computes.
    "repacked layer unsent": (without_one_projection, "Qwen/Qwen3-0.6B", True,
                              ["model.layers.0.self_attn.o_proj.weight"]),
    # A hybrid's state-layer vector: small on the log-probs of a shrunk model (a rollout's gap can stay within the
    # gate's 16-bit bound), named all the same by a fresh load.
    "state layer's dt_bias unsent": (without_one_dt_bias, "Qwen/Qwen3.5-4B", True,
                                     ["model.layers.0.linear_attn.dt_bias"]),
}  # fmt: skip


@pytest.mark.parametrize("case", STALE)
def test_a_fresh_engine_names_what_the_sync_left_stale(case, tmp_path, monkeypatch):
    """The comparison has power: with the buffers left out of the sync (GLM-4.5-Air), vLLM's reload writing every
    tensor (gpt-oss's sinks, CPU repacking) or one repacked layer's weight not sent, exactly those tensors are found
    stale."""
    inject, name, repack, stale = STALE[case]
    inject(monkeypatch)
    model, engine = engine_for(name, tmp_path, repack)
    sync.WeightPlan(model).sync(engine)
    assert differences(engine, model)[0] == stale
