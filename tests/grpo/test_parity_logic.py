"""The parity guard's decisions (colograd/grpo/parity.py) on hand-made gaps, and the two fixes that keep a model's
training forward and the engine's model the same without a run: every dropout off, and the architecture name vLLM
picks its model by; the diagnosis's sentence for each outcome of its comparison, and which tensors the sync copies
in again after vLLM's reload. The runs themselves are in tests/zoo/test_parity.py."""

from contextlib import contextmanager

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PhimoeConfig, PhimoeForCausalLM

from colograd.config.loading import disable_dropout
from colograd.engine.core import Engine
from colograd.engine.settings import architecture_name
from colograd.engine.weights import split_unprocessed
from colograd.grpo import parity, parity_diagnosis
from colograd.grpo.parity import GATE_DEFERRALS, Gap, ParityError, ParityGuard, tolerance

FP32 = tolerance(torch.float32, torch.float32)


def one_rank(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def rollout(guard: ParityGuard, gaps: list[float], engine_nan: bool = False) -> None:
    """One rollout whose first slice shows `gaps` (one token each), then the guard's check."""
    guard.begin()
    engine = torch.zeros(1, len(gaps)) + (float("nan") if engine_nan else 0.0)
    guard.observe(torch.tensor([gaps]), engine, torch.ones(1, len(gaps)))
    guard.check(step=1, gather=one_rank)


def test_tolerance_is_the_coarser_side():
    assert tolerance(torch.float32, torch.float32).precision == "float32"
    assert tolerance(torch.bfloat16, torch.float32).precision == "16-bit"
    assert tolerance(torch.float32, torch.bfloat16).precision == "16-bit"
    assert tolerance(torch.float32, torch.float32).max < tolerance(torch.bfloat16, torch.bfloat16).max


def test_gap_counts_only_sampled_and_scored_tokens():
    gap = Gap()
    trainer = torch.tensor([[0.0, 5.0, 7.0, 1.0]])
    engine = torch.tensor([[0.5, float("nan"), 0.0, 0.0]])
    sampled = torch.tensor([[1, 1, 0, 1]])  # token 2 is a tool result; token 1 was not asked
    gap.add(trainer, engine, sampled)
    assert gap.tokens == 2 and gap.max == 1.0 and gap.mean == pytest.approx(0.75)


def test_the_gate_stops_on_the_first_rollout_past_either_bound():
    with pytest.raises(ParityError, match="before training") as err:
        rollout(ParityGuard(FP32, "m"), [0.0, FP32.max * 2])  # one token far off
    assert "\n" not in str(err.value) and "engine_parity: warn" in str(err.value)
    with pytest.raises(ParityError):
        rollout(ParityGuard(FP32, "m"), [FP32.mean * 2] * 8)  # every token a little off
    rollout(ParityGuard(FP32, "m"), [FP32.mean / 2] * 8)  # within both: trains


def test_warn_only_warns(caplog):
    guard = ParityGuard(FP32, "m", stop=False)
    rollout(guard, [1.0])
    assert not guard.gate_pending and guard.stopped is None
    assert "Training on" in caplog.text


def test_the_running_guard_warns_once_and_stops_when_it_persists(caplog):
    guard = ParityGuard(FP32, "m")
    rollout(guard, [0.0])  # the gate: fine
    for _ in range(parity.PERSISTENT - 1):
        rollout(guard, [1.0])
        assert guard.stopped is None
    assert caplog.text.count("engine and trainer disagree") == 1
    rollout(guard, [0.0])  # one good rollout resets the count
    for _ in range(parity.PERSISTENT):
        rollout(guard, [1.0])
    assert guard.stopped is not None and "stopped with a checkpoint" in guard.stopped


def gated(guard: ParityGuard, trained: list[float], settled: list[float]) -> None:
    """The gate's rollout: the engine's log-probs 0, the trainer's `trained` in its training pass and `settled` in its
    evaluation pass (one token each)."""
    guard.begin()
    engine = torch.zeros(1, len(trained))
    guard.observe(torch.tensor([trained]), engine, torch.ones(1, len(trained)), torch.tensor([settled]))
    guard.check(step=1, gather=one_rank)


def test_the_gate_judges_the_engine_by_the_evaluation_pass():
    """The gate compares the engine with the policy's evaluation pass, which draws no random numbers: a training pass
    far off with an evaluation pass on the engine's trains; an evaluation pass far off stops, whatever the training
    pass reads."""
    gated(guard := ParityGuard(FP32, "m", stop=True), [0.0, 0.0], [0.0, 0.0])
    assert guard.running  # the two passes agree: the running guard reads the training pass from here
    with pytest.raises(ParityError, match="0.5 nats from the trainer's at worst"):
        gated(ParityGuard(FP32, "m"), [0.0, 0.0], [0.0, 0.5])


def test_a_training_pass_unlike_the_evaluation_pass_turns_the_running_guard_off(caplog):
    """A layer that draws random numbers in training (a router's jitter, Phi-3.5-MoE's sampled routing, dropout under
    a name of its own) makes the training pass differ from the evaluation pass on the gate's tokens: the running guard,
    which reads the training pass, is off from there (said once, no collective), and the gate still judged the
    engine. A difference within a tenth of the tolerance's mean keeps it on."""
    noise = FP32.mean * parity.TRAINING_NOISE
    gated(guard := ParityGuard(FP32, "m"), [noise * 0.9, 0.0], [0.0, 0.0])
    assert guard.running and "training pass differs" not in caplog.text
    with caplog.at_level("WARNING"):
        gated(guard := ParityGuard(FP32, "m"), [0.05, 0.0], [0.0, 0.0])
    assert not guard.running and not guard.gate_pending
    assert "training pass differs from its evaluation pass by up to 0.05 nats" in caplog.text
    assert "the running guard, which reads the training pass, is off" in caplog.text

    def no_collective(tensor):
        raise AssertionError("the guard is off on every rank alike: no collective")

    for _ in range(parity.PERSISTENT + 1):  # far off, rollout after rollout: nothing measured, nothing stopped
        guard.begin()
        guard.observe(torch.tensor([[9.0]]), torch.zeros(1, 1), torch.ones(1, 1))
        guard.check(step=2, gather=no_collective)
    assert guard.stopped is None
    guard.restart()  # a resume gates again, on the evaluation pass; the running guard stays off
    with pytest.raises(ParityError):
        gated(guard, [0.0], [1.0])
    assert not guard.running


def test_noise_that_starts_after_the_gate_is_found_before_it_stops_a_run(caplog):
    """A training pass whose noise starts after the gate (dropout, under a name of its own, on a new adapter: zero at
    the first rollout) moves the running guard's gap past the bound; the next rollout compares the evaluation pass
    too, finds the two passes apart and turns the running guard off instead of counting toward a stop. An engine
    really off is still stopped, each recheck counting."""
    guard = ParityGuard(FP32, "m")
    gated(guard, [0.0], [0.0])
    assert guard.running and not guard.comparing
    rollout(guard, [1.0])  # the training pass only, past the bound
    assert guard.over == 1 and guard.comparing
    with caplog.at_level("WARNING"):
        gated(guard, [1.0], [0.0])  # rechecked: the evaluation pass is on the engine's
    assert not guard.running and guard.over == 0 and guard.stopped is None and not guard.comparing
    assert "differs from its evaluation pass by up to 1 nats on the tokens of the rollout of step 1" in caplog.text
    off = ParityGuard(FP32, "m")
    gated(off, [0.0], [0.0])
    rollout(off, [1.0])
    for _ in range(parity.PERSISTENT - 1):  # rechecked: both passes off the engine's alike
        gated(off, [1.0], [1.0])
    assert off.running and off.stopped is not None


def test_with_the_running_guard_off_every_spot_checked_rollout_is_compared_on_the_evaluation_pass(monkeypatch):
    """Off (the training pass carries noise), the running guard still compares one rollout in `SPOT_CHECK` with the
    evaluation pass: the rollouts between make no collective; a spot check within the bound does nothing; one past it
    is rechecked on the rollouts after it and stops the run after `PERSISTENT`, as a sync broken mid-run would."""
    monkeypatch.setattr(parity, "SPOT_CHECK", 3)

    def no_collective(tensor):
        raise AssertionError("not a spot check: no collective")

    guard = ParityGuard(FP32, "m", running=False)
    gated(guard, [5.0], [0.0])  # the gate: the evaluation pass on the engine's
    for _ in range(2):
        assert not guard.comparing
        guard.begin()
        guard.check(step=2, gather=no_collective)
    assert guard.comparing
    gated(guard, [5.0], [0.0])  # the spot check: fine
    assert not guard.comparing and guard.over == 0
    for _ in range(2):
        guard.begin()
        guard.check(step=3, gather=no_collective)
    for _ in range(parity.PERSISTENT):  # a spot check past the bound, then its rechecks
        assert guard.comparing and guard.stopped is None
        gated(guard, [5.0], [1.0])
    assert guard.stopped is not None and not guard.running


def test_the_evaluation_pass_runs_only_at_the_gate_and_leaves_the_model_training():
    model = nn.Linear(2, 2).train()
    modes = []
    read = lambda: modes.append(model.training) or torch.zeros(1, 1)  # noqa: E731
    guard = ParityGuard(FP32, "m")
    assert guard.settled_logps(model, read) is None  # no rollout begun
    guard.begin()
    assert guard.settled_logps(model, read) is not None and modes == [False] and model.training
    assert guard.settled_logps(model.eval(), read) is None  # an evaluation forward of the trainer's own: not gated
    model.train()
    gated(guard, [0.0], [0.0])
    guard.begin()
    assert guard.settled_logps(model, read) is None and modes == [False]  # past the gate: the training pass only
    assert ParityGuard(FP32, "m", active=False).settled_logps(model, read) is None


def test_a_gate_whose_engine_scored_none_of_its_samples_stops(caplog):
    """The engine's log-prob of every token it sampled is NaN (its model computes NaN, or the read-back lost them):
    nothing vouches for the engine, and the gate stops as it does past the bound (it used to warn and train); one
    scored token is enough to measure; a rollout that sampled nothing warns."""
    with pytest.raises(ParityError) as err:
        rollout(ParityGuard(FP32, "m"), [5.0, 0.0], engine_nan=True)
    line = str(err.value)
    assert "\n" not in line and "no log-prob (NaN) for any of the 2 tokens" in line and "engine_parity: warn" in line
    warned = ParityGuard(FP32, "m", stop=False)
    rollout(warned, [5.0], engine_nan=True)
    assert "not measured before training" in caplog.text and not warned.gate_pending
    guard = ParityGuard(FP32, "m")
    guard.begin()
    guard.observe(torch.zeros(1, 2), torch.tensor([[float("nan"), 0.0]]), torch.ones(1, 2))
    guard.check(step=1, gather=one_rank)  # one token scored, within the bound: trains
    empty = ParityGuard(FP32, "m")
    for _ in range(GATE_DEFERRALS + 1):  # the gate waits past rollouts with nothing to compare, then says so
        assert empty.gate_pending and "sampled no token" not in caplog.text
        empty.begin()
        empty.observe(torch.zeros(1, 2), torch.full((1, 2), float("nan")), torch.zeros(1, 2))
        empty.check(step=1, gather=one_rank)
    assert "sampled no token" in caplog.text and not empty.gate_pending


def nothing_to_compare(guard: ParityGuard) -> None:
    """A rollout whose first slice holds no token sampled under the current weights (resumed completions under
    routing replay: `pad_rollout` leaves them out of the comparison)."""
    guard.begin()
    guard.observe(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2))
    guard.check(step=3, gather=one_rank)


def test_a_gate_with_nothing_to_compare_gates_the_next_rollout_that_has(caplog):
    """A resumed run's first slice can hold only partial rollouts' resumed completions, none of whose tokens compare
    (under routing replay): the gate is the first rollout with tokens to compare, and stops the run there, saying
    which, as it stops a start's first rollout."""
    guard = ParityGuard(FP32, "m")
    nothing_to_compare(guard)
    assert guard.gate_pending and caplog.text == ""
    with pytest.raises(ParityError, match=r"disagree on m at step 1: .*over 1 tokens \(rollout 2 \(the first with "):
        rollout(guard, [0.5])
    healthy = ParityGuard(FP32, "m")
    nothing_to_compare(healthy)
    rollout(healthy, [1e-6])
    assert not healthy.gate_pending and caplog.text == ""
    healthy.restart()
    assert healthy.gate_pending and healthy.deferred == 0


def test_a_loss_that_skips_the_guards_call_is_said_so_and_one_that_makes_it_is_measured(caplog):
    """The guard is one call in the loss (`measured`): a rollout whose first slice was trained without it (an override
    of compute_loss that computes its own log-probs) stops the run in one line, or warns once under warn; through
    the call, the training pass's log-probs are measured and returned as they are."""
    model = nn.Linear(1, 1).train()
    inputs = {"engine_logps": torch.zeros(1, 2), "tool_mask": torch.ones(1, 2)}
    guard = ParityGuard(FP32, "m")
    guard.begin()
    with pytest.raises(ParityError, match=r"^the parity guard measured nothing of m: .*compute_loss") as err:
        guard.check(step=1, gather=one_rank)
    assert "\n" not in str(err.value)
    warned = ParityGuard(FP32, "m", stop=False)
    for _ in range(2):
        warned.begin()
        warned.check(step=1, gather=one_rank)
    assert caplog.text.count("measured nothing") == 1
    guard = ParityGuard(FP32, "m")
    guard.begin()
    off = torch.tensor([[0.0, 5.0]])  # 5 nats on a token, in both passes (the gate reads the evaluation pass)
    out = guard.measured(model, inputs, lambda: off, lambda: (off, "entropy"))
    assert out[1] == "entropy" and model.training
    with pytest.raises(ParityError, match="disagree on m before training"):  # measured
        guard.check(step=1, gather=one_rank)
    guard = ParityGuard(FP32, "m")
    guard.begin()
    guard.measured(model, inputs, lambda: torch.zeros(1, 2), lambda: torch.zeros(1, 2))
    guard.check(step=1, gather=one_rank)  # measured, within the bound: trains


def test_nan_where_the_engine_was_asked_is_past_any_bound_at_the_gate_and_after_it(caplog):
    """A rollout records which completions the engine was asked to score (`Rollout.asked`): a NaN among those is the
    engine's own. At the gate one such token stops the run even where others were scored within the bound; after
    the gate, rollouts with such tokens count toward the running guard's stop as rollouts past the bound do (the
    run stops after `PERSISTENT` in a row). A NaN where the engine was not asked is nothing."""
    engine = torch.tensor([[0.0, float("nan")]])
    trained, sampled = torch.zeros(1, 2), torch.ones(1, 2)
    asked, not_asked = torch.tensor([True]), torch.tensor([False])

    def step(guard: ParityGuard, asked_N: torch.Tensor, at: int = 1) -> None:
        guard.begin()
        guard.observe(trained, engine, sampled, asked_N=asked_N)
        guard.check(step=at, gather=one_rank)

    with pytest.raises(ParityError, match=r"^the engine computes NaN for m before training: .* for 1 of the 2 tok"):
        step(ParityGuard(FP32, "m"), asked)
    step(ParityGuard(FP32, "m"), not_asked)  # the other token is scored, within the bound: trains
    guard = ParityGuard(FP32, "m")
    rollout(guard, [0.0])  # the gate passes
    for at in range(2, 2 + parity.PERSISTENT):
        assert guard.stopped is None
        step(guard, asked, at)
    assert guard.stopped and "computes NaN for m at step" in guard.stopped and "\n" not in guard.stopped
    assert "computes NaN" in caplog.text  # said at the first such rollout
    warned = ParityGuard(FP32, "m", stop=False)
    rollout(warned, [0.0])
    for at in range(2, 12):
        step(warned, asked, at)
    assert warned.stopped is None
    recovering = ParityGuard(FP32, "m")
    rollout(recovering, [0.0])
    for at in range(2, 12):  # one rollout in two: never PERSISTENT in a row
        step(recovering, asked if at % 2 else not_asked, at)
    assert recovering.stopped is None


def test_a_restart_gates_again():
    guard = ParityGuard(FP32, "m")
    rollout(guard, [0.0])
    guard.restart()
    with pytest.raises(ParityError):
        rollout(guard, [1.0])


class ResidualDropout(nn.Module):
    """A family's dropout under a name of its own, applied as a function (as OLMo's and Phi's residual ones are)."""

    def __init__(self) -> None:
        super().__init__()
        self.residual_dropout = 0.5
        self.resid_pdrop = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.dropout(x, p=self.residual_dropout, training=self.training)
        return nn.functional.dropout(x, p=self.resid_pdrop, training=self.training)


def test_disable_dropout_turns_off_dropout_under_any_name():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=1, attention_dropout=0.3))  # fmt: skip
    model.model.norm = nn.Sequential(model.model.norm, ResidualDropout())
    model.config.hidden_dropout = 0.2  # read from the config at forward time by some families
    model.train()
    ids = torch.arange(16).unsqueeze(0)
    assert not torch.equal(model(ids).logits, model(ids).logits)  # dropout is on
    disable_dropout(model)
    assert torch.equal(model(ids).logits, model(ids).logits)
    assert model.config.attention_dropout == 0.0 and model.config.hidden_dropout == 0.0
    assert model.config.use_cache is True  # other fields kept


def test_the_engine_is_told_vllms_name_of_the_architecture():
    """transformers' class `PhimoeForCausalLM` is vLLM's (and the checkpoints') `PhiMoEForCausalLM`: told the class
    name, vLLM falls back to its Transformers backend. A class vLLM knows keeps its name."""
    config = PhimoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=1, num_key_value_heads=1, num_local_experts=2)  # fmt: skip
    assert architecture_name(PhimoeForCausalLM(config)) == "PhiMoEForCausalLM"
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=1))  # fmt: skip
    assert architecture_name(llama) == "LlamaForCausalLM"


def test_a_class_vllm_lacks_takes_the_checkpoints_declared_name():
    class RenamedLlama(LlamaForCausalLM):
        pass

    model = RenamedLlama(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=1, architectures=["LlamaForCausalLM"]))  # fmt: skip
    assert architecture_name(model) == "LlamaForCausalLM"
    model.config.architectures = None
    assert architecture_name(model) == "RenamedLlama"  # nothing better known: the class (vLLM's backend, or refusal)


def test_filtered_sampling_turns_the_guard_off():
    """top-p / top-k / min-p / a repetition penalty make the engine sample from another distribution by design: the
    guard then measures nothing and stops nothing (and makes no collective)."""
    from colograd import GRPOConfig

    assert GRPOConfig(output_dir="unused", report_to="none").samples_unfiltered
    assert not GRPOConfig(output_dir="unused", report_to="none", min_p=0.05).samples_unfiltered
    guard = ParityGuard(FP32, "m", active=False)
    assert not guard.gate_pending
    rollout(guard, [10.0])  # would stop an active guard
    guard.restart()
    assert not guard.gate_pending


def test_dropout_in_training_turns_the_guard_off_saying_so(caplog):
    """A policy that applies dropout while training (TRL's `lora_dropout` 0.05, without `disable_dropout`) scores the
    engine's samples with the dropout's noise: from the first update of the adapter on, a healthy run's gap is past the
    float32 bound and the running guard stopped it, blaming vLLM. The guard is off then, said once; with
    `disable_dropout` it is on."""
    from peft import LoraConfig, get_peft_model

    from colograd import GRPOConfig
    from colograd.config.loading import dropouts_in_use
    from colograd.models import tiny

    args = GRPOConfig(output_dir="unused", report_to="none")
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear")
    model = get_peft_model(tiny.build_model(), lora)
    noisy = dropouts_in_use(model)
    assert len(noisy) == 14 and noisy[0].endswith("q_proj.lora_dropout.default (0.05)")  # 7 projections, 2 layers
    with caplog.at_level("WARNING"):
        guard = ParityGuard.of_run(model, args)
    assert guard.gate_pending and not guard.running  # the gate reads the evaluation pass, which has no dropout
    assert "the policy applies dropout while training (base_model.model.model.layers.0.self_attn.q_proj" in caplog.text
    assert "and 13 more): its log-probs differ from the engine's by the dropout's noise" in caplog.text
    assert "so the running guard is off (the parity gate still compares" in caplog.text
    disable_dropout(model)
    assert dropouts_in_use(model) == [] and ParityGuard.of_run(model, args).running
    assert ParityGuard.of_run(tiny.build_model(), args).running  # no dropout: measured as always
    residual = ResidualDropout()
    assert dropouts_in_use(residual) == ["residual_dropout (0.5)", "resid_pdrop (0.5)"]  # a family's own names


@pytest.mark.slow  # four GRPO steps in process
def test_a_lora_run_with_trls_adapter_dropout_trains_on(tmp_path):
    """TRL's LoRA default (`lora_dropout` 0.05) and GRPO's (`disable_dropout` false), as in recipes without
    `disable_dropout`: the run trains to its last step (the running guard stopped it at step 4, blaming vLLM)."""
    from peft import LoraConfig

    from colograd import GRPOConfig, GRPOTrainer
    from colograd.models import tiny

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=4, report_to="none", save_strategy="no",
                      vllm_enforce_eager=True, max_completion_length=8, per_device_train_batch_size=16,
                      learning_rate=2e-3)  # fmt: skip
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear")
    trainer = GRPOTrainer(model=tiny.build_model(), reward_funcs=tiny.letters_reward, args=args, peft_config=lora,
                          train_dataset=tiny.letters_dataset(64), processing_class=tiny.build_tokenizer())  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 4
    gaps = [e["sampling/sampling_logp_difference/mean"] for e in trainer.state.log_history if "loss" in e]
    assert max(gaps) > parity.tolerance(torch.float32, torch.float32).mean  # the noise the guard would have stopped


class Diagnosis:
    """A `diagnose` callable that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        return "A freshly loaded engine differs: model.layers.0.attn.sinks."


def test_the_gates_stop_carries_the_diagnosis_once():
    """The gate's line names the cause its diagnosis found instead of both possible ones; a gate that only warns
    does not pay for a diagnosis."""
    diagnosis = Diagnosis()
    with pytest.raises(ParityError) as err:
        rollout(ParityGuard(FP32, "m", diagnose=diagnosis), [1.0])
    line = str(err.value)
    assert "\n" not in line and diagnosis.calls == 1
    assert "trained. A freshly loaded engine differs: model.layers.0.attn.sinks. Set engine_parity: warn" in line
    assert parity.EITHER_CAUSE not in line
    rollout(ParityGuard(FP32, "m", stop=False, diagnose=diagnosis), [1.0])
    assert diagnosis.calls == 1
    with pytest.raises(ParityError) as err:
        rollout(ParityGuard(FP32, "m"), [1.0])
    assert parity.EITHER_CAUSE in str(err.value)  # no diagnosis: both causes named


def test_the_running_guards_stop_carries_the_diagnosis_once(caplog):
    diagnosis = Diagnosis()
    guard = ParityGuard(FP32, "m", diagnose=diagnosis)
    rollout(guard, [0.0])  # the gate: fine
    for _ in range(parity.PERSISTENT - 1):
        rollout(guard, [1.0])
    assert diagnosis.calls == 0 and parity.EITHER_CAUSE in caplog.text  # its warning names both causes
    rollout(guard, [1.0])
    assert diagnosis.calls == 1 and "A freshly loaded engine differs" in guard.stopped
    assert "\n" not in guard.stopped and guard.stopped.endswith("set engine_parity: warn to train on.")


def tiny_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=1))  # fmt: skip


class StandInEngine:
    """What `diagnose` reads of an engine, with the comparison's answer (or error) given."""

    def __init__(
        self, answer, direct_load: bool = False, sleeping: bool = False, packed_released: bool = False
    ) -> None:
        self.answer, self.direct_load, self.sleeping, self.packed_released = (
            answer,
            direct_load,
            sleeping,
            packed_released,
        )
        self.settings = {"architecture": {"architectures": ["LlamaForCausalLM"]}}
        self.woken = 0

    serves_adapter = False
    on_held_weights = Engine.on_held_weights  # the engine's own rule, on the stand-in's state

    def in_workers(self, function, *args):
        if isinstance(self.answer, Exception):
            raise self.answer
        return [self.answer]

    def wake_weights(self):
        pass

    @contextmanager
    def awake(self):
        self.woken += 1
        yield


def test_the_diagnosis_names_the_stale_tensors_or_the_engines_model():
    model = tiny_llama()
    stale = [f"model.layers.0.t{i}" for i in range(7)]
    line = parity_diagnosis.diagnose(StandInEngine((stale, 40, [])), model)
    assert line.startswith("A freshly loaded engine differs: 7 of the engine's 40 tensors and layers are not")
    assert "model.layers.0.t0, model.layers.0.t1" in line and "t4 and 2 more" in line and "t5" not in line
    # No advice on the other sync path, on either: it was given where it changed nothing (Granite-4.0-H's experts).
    assert "colograd's sync leaves them stale" in line and "vllm_cpu_repack_weights" not in line
    line = parity_diagnosis.diagnose(StandInEngine((stale[:1], 40, []), direct_load=True), model)
    assert "1 of the engine's 40 tensors and layers is not" in line and "vllm_cpu_repack_weights" not in line
    line = parity_diagnosis.diagnose(StandInEngine(([], 40, [])), model)
    assert line.startswith("A freshly loaded engine agrees: all 40")
    assert "vLLM's LlamaForCausalLM and the trainer's forward compute different distributions" in line
    assert "another vLLM release" not in line  # advice nobody checked changes the outcome
    # Differing only where vLLM's loader writes nothing, a fresh load too: vLLM's model, whatever the sync sends.
    line = parity_diagnosis.diagnose(StandInEngine((stale[:2], 40, stale[:2])), model)
    assert line.startswith("A freshly loaded engine differs only in tensors vLLM's loader never writes (")
    assert "vLLM's model is at fault, not colograd's sync" in line and "colograd's sync leaves" not in line
    line = parity_diagnosis.diagnose(StandInEngine((stale[:2], 40, stale[:1])), model)  # one the sync left stale
    assert "colograd's sync leaves them stale" in line
    failed = parity_diagnosis.diagnose(StandInEngine(RuntimeError("out of\nmemory")), model)
    assert failed == "The engine was not compared with a fresh load (RuntimeError: out of memory)."
    line = parity_diagnosis.diagnose(StandInEngine(([], 40, []), sleeping=True), model)  # asleep, no way to resync
    assert "\n" not in line and line.startswith("The engine was not compared") and "released its weights" in line
    asleep, synced = StandInEngine(([], 40, []), sleeping=True), []
    assert "agrees" in parity_diagnosis.diagnose(asleep, model, resync=lambda: synced.append(1))
    assert asleep.woken == 1 and synced == [1]  # woken, and the weights written back, for the comparison
    # A CPU engine that dropped its packed weights after the rollout is synced again the same way.
    released, synced = StandInEngine(([], 40, []), packed_released=True), []
    assert "agrees" in parity_diagnosis.diagnose(released, model, resync=lambda: synced.append(1))
    assert released.woken == 1 and synced == [1]
    awake = StandInEngine(([], 40, []))
    assert "agrees" in parity_diagnosis.diagnose(awake, model, resync=lambda: synced.append(1)) and awake.woken == 0


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_saved_weights_are_what_save_pretrained_writes(tied, tmp_path):
    """Every parameter and persistent buffer by its checkpoint name, a tied output layer once, under the name the
    model loads it by: the tensors `save_pretrained` writes, bit for bit. (With the tied output layer given twice,
    vLLM's Gemma-3n, which holds no output layer, refused the fresh load, and the diagnosis was lost.)"""
    from safetensors.torch import load_file

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=1, tie_word_embeddings=tied))  # fmt: skip
    model.model.register_buffer("kept", torch.ones(2))
    model.model.register_buffer("dropped", torch.ones(2), persistent=False)
    names = dict(parity_diagnosis.saved_weights(model))
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert set(names) == set(saved) and all(names[name].equal(tensor) for name, tensor in saved.items())
    assert "model.kept" in names and "model.dropped" not in names
    assert ("lm_head.weight" in names) is not tied and "model.embed_tokens.weight" in names


class Mapper:
    """vLLM's `WeightsMapper`, as `split_unprocessed` reads it: a checkpoint name to the engine's (None: dropped)."""

    def _map_name(self, name: str) -> str | None:
        return None if name.startswith("ignored.") else name.replace("self_attn.", "attn.")


class Processed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))

    def process_weights_after_loading(self, dtype) -> None:
        pass


def test_the_tensors_copied_in_after_vllms_reload_are_those_nothing_processes():
    """A norm's weight and an attention sink (held by a module with no quant method and no post-load step) are copied
    in again after vLLM's reload; a quantized or post-processed layer's, a repacked-away (empty) tensor, a fused
    module's checkpoint name and a name the model drops are left to the reload."""
    model = nn.Module()
    model.hf_to_vllm_mapper = Mapper()
    attn = nn.Module()
    attn.sinks = nn.Parameter(torch.ones(2))
    attn.register_buffer("bias", torch.ones(2))
    attn.register_parameter("empty", nn.Parameter(torch.empty(0)))
    quantized = nn.Linear(2, 2)
    quantized.quant_method = object()
    model.attn, model.norm, model.quantized, model.processed = attn, nn.LayerNorm(2), quantized, Processed()
    names = ["self_attn.sinks", "attn.bias", "norm.weight", "attn.empty", "quantized.weight", "processed.weight",
             "attn.q_proj.weight", "ignored.x", "norm.nothing"]  # fmt: skip
    unprocessed, rest = split_unprocessed(model, [(name, i) for i, name in enumerate(names)])
    assert [name for name, _ in unprocessed] == ["self_attn.sinks", "attn.bias", "norm.weight"]
    assert [value for _, value in rest] == [3, 4, 5, 6, 7, 8]  # the rest in the order given


@pytest.mark.slow  # one engine start, in process
def test_an_engine_computing_nan_stops_the_run_before_training(tmp_path, monkeypatch):
    """The sync hands the engine a NaN final norm, so the engine's model computes NaN and scores none of its samples:
    the gate stops the run at its first rollout, before any optimizer step (it used to warn that it "measured no
    token" and train on, the loss standing in the trainer's own log-probs for the engine's)."""
    from colograd import GRPOConfig, GRPOTrainer
    from colograd.models import tiny

    own = Engine.load_weights
    monkeypatch.setattr(Engine, "load_weights", lambda engine, weights: own(engine, [
        (n, torch.full_like(t, float("nan")) if n == "model.norm.weight" else t) for n, t in weights]))  # fmt: skip
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", save_strategy="no",
                      vllm_enforce_eager=True, max_completion_length=8)  # fmt: skip
    trainer = GRPOTrainer(model=tiny.build_model(), reward_funcs=tiny.letters_reward, args=args,
                          train_dataset=tiny.letters_dataset(16), processing_class=tiny.build_tokenizer())  # fmt: skip
    with pytest.raises(ParityError) as err:
        trainer.train()
    assert "\n" not in str(err.value) and "no log-prob (NaN)" in str(err.value)
    assert trainer.state.global_step == 0


@pytest.mark.slow
@pytest.mark.parametrize("rollouts", [{}, {"partial_rollouts": True}], ids=["whole", "partial"])
def test_an_engine_that_starts_computing_nan_later_stops_the_run(tmp_path, monkeypatch, rollouts):
    """From the third rollout on, the sync hands the engine a NaN final norm: the gate passed, and the engine is asked
    only the sampling-gap metric's completion (partial rollouts: every token, through their own request loop). Its
    NaN is the engine's own (the rollout records that it asked), so the running guard counts each such rollout past
    the bound and stops the run after `PERSISTENT` of them, with a checkpoint (it used to read them as "nothing
    measured" and train to the end)."""
    from colograd import GRPOConfig, GRPOTrainer
    from colograd.models import tiny

    own, trainer = Engine.load_weights, None

    def load_weights(engine, weights):
        broken = trainer is not None and trainer.state.global_step >= 2
        own(engine, [(n, torch.full_like(t, float("nan")) if broken and n == "model.norm.weight" else t)
                     for n, t in weights])  # fmt: skip

    monkeypatch.setattr(Engine, "load_weights", load_weights)
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=8, report_to="none", save_strategy="no",
                      vllm_enforce_eager=True, max_completion_length=8, **rollouts)  # fmt: skip
    trainer = GRPOTrainer(model=tiny.build_model(), reward_funcs=tiny.letters_reward, args=args,
                          train_dataset=tiny.letters_dataset(64), processing_class=tiny.build_tokenizer())  # fmt: skip
    with pytest.raises(ParityError) as err:
        trainer.train()
    line = str(err.value)
    assert "\n" not in line and "the engine computes NaN for" in line and "at step 5" in line, line
    assert trainer.state.global_step == 2 + parity.PERSISTENT  # stopped at the third rollout of NaN
    assert (tmp_path / f"checkpoint-{trainer.state.global_step}").is_dir()
