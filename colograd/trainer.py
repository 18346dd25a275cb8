"""`GRPOTrainer`: transformers' `Trainer` with a colocated engine, one small method per GRPO stage.

A rollout on each rank (every `steps_per_generation × num_iterations` micro-steps):

    sync_weights       if the optimizer stepped since the last rollout, write its weights into the engine
    prepare_prompts    template and tokenize this rank's B prompts (`sample` then keeps the last `prompt_limit` tokens)
    generate           one engine call: B prompts × G completions (n=G shares each prompt's prefill)
    score              reward functions, in this rank
    compute_advantages per group; batch-wide scaling, and groups that span ranks, gather every rank's rewards
    rollout_logps      old (sampling-policy) and reference log-probs, once per rollout, when the loss needs them

then each micro-step trains on one slice of it:

    compute_loss       GRPO clipped policy-gradient loss (+ beta × KL); backward and optimizer step are the Trainer's

Subclass and override one of these to change that stage alone: a stage returns values and owes nothing else. The
trainer records the metrics from what the stages return (`colograd.rollout.core`); `sample` runs the first three
stages for training and evaluation alike.
"""

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from trl.data_utils import is_conversational

from colograd.agents.core import Agents, RolloutFunc, VLLMGeneration
from colograd.agents.tools import ToolCallParser
from colograd.config.core import GRPOConfig
from colograd.config.loading import model_name
from colograd.config.trl_compat import TRLTrainerAttributes
from colograd.data.core import keep_rows, tokenize_prompts
from colograd.data.streaming import RolloutBatches, check_stream_resume, named_rows, row_names
from colograd.engine.core import Engine
from colograd.engine.lifetime import frozen_heap, own_classes
from colograd.engine.requests import Sampling
from colograd.engine.rollout import Rollout, RolloutContext
from colograd.engine.sync import WeightPlan
from colograd.forward.batch import RolloutBatch, rollout_batch, split_rows
from colograd.forward.core import Forward
from colograd.forward.router import Router, RouterRecord, check_replay, router_of
from colograd.grpo import parity_diagnosis
from colograd.grpo.entropy import EntropyTerms
from colograd.grpo.loss import (
    Gather,
    engine_old_logps,
    group_advantages,
    importance_ratio_metrics,
    importance_sampling,
    loss_metrics,
    normalize_then_sum,
    objective,
    policy_loss,
    sampling_correction,
    sampling_gap_metrics,
    spanned_advantages,
    weighted_rewards,
)
from colograd.grpo.parity import ParityError, ParityGuard, ParityStop
from colograd.grpo.placement import prepare_on_cpu
from colograd.grpo.policy import prepare_policy, weight_plan
from colograd.grpo.reference import ReferencePolicy
from colograd.models import logit_transform
from colograd.preflight.trainer import check_call, check_trainer, check_wrapped_trainer
from colograd.rewards.core import RewardFunc, RewardModel, TimeLimits, resolve_rewards, reward_name
from colograd.rewards.early import early_rewards, group_starter
from colograd.rollout.core import (
    PreparedPrompts,
    ScoredRollout,
    gap_sampling,
    sampled_lengths,
    score_rollout,
    scored_metrics,
    vision_prompts,
)
from colograd.rollout.dynamic import ROUND_STRIDE, DynamicSampling
from colograd.rollout.evaluation import evaluate
from colograd.rollout.partial import PartialRollouts, refuse_overridden_stages
from colograd.rollout.spans import check_share, per_completion, rank_share
from colograd.runs.checkpoints import checkpoint_step
from colograd.runs.modelcard import Recipe
from colograd.runs.preemption import Preemption
from colograd.runs.ranks import across_ranks, gather_rows, largest_over_ranks
from colograd.runs.saving import ModelSaving
from colograd.runs.step_logs import StepLogs
from colograd.vision.core import is_vision_language, rotate_prompts, text_tokenizer


class GRPOTrainer(TRLTrainerAttributes, RolloutBatches, ModelSaving, StepLogs):
    """Group Relative Policy Optimization with a vLLM engine inside each training process.

    TRL 1.16's parameters, in its order, with its meanings (`colograd.config.trl_compat.TRAINER_PARAMETERS`), then
    colograd's own, by keyword.

    Args:
        model: a causal LM (a `PeftModel` too), or a hub id / local path to load one from.
        reward_funcs: reward functions (TRL's signature, sync or async), sequence-classification reward models
            (`RewardModel`s, bare models, hub ids), or names (see `colograd.rewards.core.resolve_reward`); None when an
            `environment_factory`'s environment gives the reward (`get_reward`).
        args: the run's configuration; defaults to `GRPOConfig` with output_dir `<model name>-GRPO`, as TRL's.
        train_dataset: rows with a `prompt` column (text, or chat messages); other columns reach the rewards.
        eval_dataset: prompts like train_dataset's, sampled and scored every `eval_steps` (see `evaluate`).
        processing_class: the tokenizer; loaded from `model`'s path when omitted.
        reward_processing_classes: the tokenizer of each reward model of `reward_funcs` (see `resolve_rewards`).
        callbacks: extra `TrainerCallback`s.
        optimizers: an optimizer and a learning-rate scheduler instead of the Trainer's.
        quantization_config: refused: the engine sync writes full-precision weights.
        peft_config: a PEFT config: the model is wrapped with a new adapter (`wrap_with_peft`), as TRL does.
        tools, rollout_func, environment_factory: agentic rollouts, as in TRL (see `colograd.agents.core.Agents` and
            docs/agents.md).
        recipe: the recipe a command-line run was launched from, for the model card.
        tool_call_parser: how tool calls are read from the model's text (default: the Qwen / Hermes chat-template
            format).
    """

    def __init__(
        self,
        model: PreTrainedModel | str,
        reward_funcs: RewardFunc | str | PreTrainedModel | list | None = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        reward_processing_classes: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase | None] | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list | None = None,
        rollout_func: RolloutFunc | None = None,
        environment_factory: Any = None,
        *,
        recipe: Recipe | None = None,
        tool_call_parser: ToolCallParser | None = None,
    ) -> None:
        args = args or GRPOConfig(output_dir=f"{model_name(model)}-GRPO")
        check_call(args, model, eval_dataset, processing_class, reward_processing_classes, quantization_config)
        model, processing_class = prepare_policy(model, processing_class, args, peft_config)
        # A Mixture-of-Experts model's routers: the load-balancing loss TRL adds, and the experts' load.
        router = router_of(model, args.router_aux_loss_coef)
        self.router_aux_loss_coef = router.coef if router else 0.0  # TRL's attributes
        self.aux_loss_enabled = bool(self.router_aux_loss_coef)
        self.reward_funcs, self.reward_weights = resolve_rewards(
            reward_funcs, args.reward_weights, reward_processing_classes
        )
        self.agents = (
            Agents(processing_class, args, tools, environment_factory, rollout_func, tool_call_parser)
            if tools or environment_factory or rollout_func
            else None
        )
        check_replay(args, router, model, self.agents is not None and self.agents.rollout_func is not None)
        if self.agents is not None:
            self.agents.check_stages(type(self))
        if self.agents is not None and self.agents.reward_funcs:  # an environment's own reward, weight 1 (TRL's)
            self.reward_funcs += self.agents.reward_funcs
            self.reward_weights = torch.cat([self.reward_weights, torch.ones(len(self.agents.reward_funcs))])
        self.reward_func_names = [reward_name(f) for f in self.reward_funcs]  # TRL's attribute: metrics' names
        refuse_overridden_stages(args, type(self), GRPOTrainer)
        self.inputs = check_trainer(
            model, processing_class, args, train_dataset, eval_dataset, self.reward_funcs, agents=self.agents,
            rollout_func=rollout_func, environment_factory=environment_factory,
        )  # fmt: skip
        # Copied before the Trainer wraps the model, so the copy is the initial policy, whole on every rank.
        self.reference = ReferencePolicy(model, args) if args.beta != 0.0 else None
        super().__init__(
            model=model,
            args=args,
            data_collator=keep_rows,
            train_dataset=self.inputs.train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        check_wrapped_trainer(self)
        # compute_loss returns a per-micro-batch mean; the Trainer divides it by the accumulation steps.
        self.model_accepts_loss_kwargs = False
        prepare_on_cpu(self.accelerator, args.device)  # in place, and without DDP in a world of one
        self._start_engine(router)
        self._start_run_records(recipe)

    def _start_engine(self, router: Router | None) -> None:
        """The engine, and what the rollouts and the forward pass need of the model (after `Trainer.__init__`: the
        torch process group must exist before the engine joins it)."""
        args, inputs = self.args, self.inputs
        unwrapped = self.accelerator.unwrap_model(self.model)
        self.engine = Engine.acquire(
            unwrapped,
            self.processing_class,
            args,
            lora_rank=inputs.lora_rank,
            prompt_tokens=inputs.expected_prompt_tokens,
            longest_prompt=inputs.longest_prompt,
            images_per_prompt=inputs.images_per_prompt,
        )
        nets = [unwrapped, self.reference and self.reference.frozen]  # the policy, and the reference's copy if any
        own_classes(nets)  # vLLM's class rewrites kept out
        # A vision-language model's rows are checked at each rollout, named by the index they carry (`ROW_KEY`).
        self._vision = is_vision_language(getattr(unwrapped, "get_base_model", lambda: unwrapped)())
        self.numbered_rows = self._vision
        rank, world, dataset = self.accelerator.process_index, self.accelerator.num_processes, self.train_dataset
        self.dynamic = DynamicSampling(args, dataset, self._vision, rank, world) if args.dynamic_sampling else None
        self.partial = PartialRollouts(args, dataset, self._vision, rank, world) if args.partial_rollouts else None
        self.vllm_generation = VLLMGeneration(self)  # TRL's handle on the engine, for `rollout_func` code
        # What each model does to its logits, learnt before DeepSpeed wraps or partitions them.
        for net in filter(None, nets):
            logit_transform.of(net)
        if self.reference is not None:
            self.reference.prepare(self.accelerator)
            self.add_callback(self.reference)  # sync_ref_model's updates
        for func in self.reward_funcs:
            if isinstance(func, RewardModel):
                func.model.to(self.accelerator.device)
        self.weight_plan: WeightPlan | None = None
        main = self.accelerator.is_main_process
        self.forward = Forward.of(
            nets, args, self.processing_class, router, self.is_deepspeed_enabled, main, self.engine.holds_state
        )
        # The engine samples from the model trained, or the run stops (`colograd.grpo.parity`).
        cause = lambda: parity_diagnosis.diagnose(  # noqa: E731 - said once, when the guard stops the run
            self.engine, self.accelerator.unwrap_model(self.model), self.sync_weights, self.forward.replay is not None
        )
        self.parity = ParityGuard.of_run(unwrapped, args, diagnose=cause)
        self.add_callback(ParityStop(self.parity))

    def _start_run_records(self, recipe: Recipe | None) -> None:
        """What the run keeps between steps: the current rollout, metrics, timings, checkpointed parts, the stop on a
        signal, and the completion log."""
        self._start_logs()
        self._micro_step = 0  # micro-steps trained since start (or resume): picks the rollout slice
        self._slices: list[RolloutBatch] | None = None  # the current rollout, one slice per micro-step
        self.entropy = EntropyTerms(self.args, self.accelerator, across_ranks(self.accelerator), self.metrics)
        self.checkpoint_parts = (self.entropy,)  # written into each checkpoint before its record finishes
        # Written by every rank, each its own: the groups a rank carries between partial rollouts.
        self.rank_checkpoint_parts = (self.partial,) if self.partial is not None else ()
        self.preemption = Preemption()
        self.add_callback(self.preemption)
        self.recipe = recipe

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """transformers' `train`. `resume_from_checkpoint=True` takes the newest *finished* checkpoint of
        `output_dir` (see `colograd.runs.checkpoints`); a named one must be finished too, and saved by a run set up as
        this one (`check_setup`). A run that resumes nothing is refused where another run's work is
        (`colograd.runs.output_dir`)."""
        checkpoint = self.resume_point(resume_from_checkpoint)
        check_stream_resume(self.train_dataset, checkpoint)
        # The model is about to change (restored, or trained on from here): the first rollout re-syncs.
        self.engine.forget_synced()
        self.resume_step = checkpoint_step(checkpoint) if checkpoint else 0  # where the data continues
        # The first logging window starts where the run (re)starts: time/* are divided by its steps.
        self._last_logged_step = self.resume_step
        self.entropy.resume(checkpoint)
        if self.partial is not None:
            self.partial.resume(checkpoint)
        if checkpoint and self._completion_log is not None:
            self._completion_log.forget_after(self._last_logged_step)
        self._times.reset()  # the summary covers this call
        first_step = self._last_logged_step
        self.parity.restart()  # the first rollout from here is gated
        with self.preemption.armed(), frozen_heap(collect=True):
            output = super().train(resume_from_checkpoint=checkpoint, **kwargs)
        if self.parity.stopped:
            raise ParityError(self.parity.stopped)
        self.summarize_phases(self.state.global_step - first_step)
        return output

    # --- the step ---------------------------------------------------------------------------------------

    def training_step(
        self, model: nn.Module, inputs: list[dict], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """One micro-step: a new rollout when the last one is used up, then the Trainer's forward/backward on the
        rollout's next slice."""
        first = self._slices is None or self._micro_step % self.args.rollout_micro_steps == 0
        if first:
            self._slices = self.make_rollout(inputs)
            self.parity.begin()  # the first slice is trained on the weights that sampled it: its gap is measured
        # `fresh`: the rollout's first micro-step, trained on the weights that sampled it (`compute_loss` reads it)
        batch = self._slices[self._micro_step % self.args.steps_per_generation] | {"fresh": torch.tensor(first)}
        self._micro_step += 1
        with self._timed("train"), self.forward.training():
            loss = self.train_slice(model, batch, num_items_in_batch)
        if first:  # before the optimizer step: a gate that stops the run leaves the weights untrained
            self.parity.check(self.state.global_step + 1, self.accelerator.gather)
        return loss

    def train_slice(
        self, model: nn.Module, batch: RolloutBatch, num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """The Trainer's forward + backward on one rollout slice; with `micro_batch_tokens` (or on a GPU the budget
        derived from free memory, see `PassBudget`), in several passes of at most that many tokens, gradients
        accumulated locally until the last one."""
        passes = self.forward.passes(model, batch, self.optimizer)
        if passes is None:
            return super().training_step(model, batch, num_items_in_batch)
        loss = torch.zeros((), device=self.args.device)
        for i, part in enumerate(passes):
            # Gradients are reduced across ranks once, with the last pass (when the Trainer reduces at all).
            with self.accelerator.no_sync(model) if i < len(passes) - 1 else nullcontext():
                loss = loss + super().training_step(model, part, num_items_in_batch)
        return loss

    def make_rollout(self, rows: list[dict]) -> list[RolloutBatch]:
        """Sample and score one rollout from this rank's prompts, record its metrics, and prepare it for training;
        returns one slice per micro-step.

        First the weight sync: the last optimizer step's weights written into the engine (`sync_for_rollout`), the
        rollout's only one. Then the rollout's source: `sample`, or with dynamic sampling its refill rounds
        (`sample_dynamic`), or with partial rollouts `sample_partial`; each wakes the engine for its generation, and
        puts it back to sleep after.
        """
        args = self.args
        self.sync_for_rollout()
        if self.partial is not None:
            scored, generated = self.sample_partial(rows)
        elif self.dynamic is not None:
            scored, generated = self.sample_dynamic(rows)
        else:
            counts = None
            if args.groups_span_ranks:  # every rank read the rollout's prompts: it samples its slice of their groups
                per_rank = args.per_device_train_batch_size * args.steps_per_generation
                first, counts = rank_share(len(rows), args.num_generations, per_rank, self.accelerator.process_index)
                rows = rows[first : first + len(counts)]
            scored = self.sample(rows, counts=counts)
            generated = int(sampled_lengths(scored.rollout).sum())
        if args.routing_replay == "rollout" and scored.rollout.routed is None:  # else the passes route themselves
            raise RuntimeError(
                "routing_replay=rollout, and the rollout carries no routing (Rollout.routed): a generate override "
                "must return the engine's (Engine.generate records it); or set routing_replay: off."
            )
        extra, logged = scored.rollout.reward_logs.take()  # what its reward functions logged (TRL's log_extra ...)
        self._times.count("generated", generated, self.metrics)
        advantages_N = self.compute_advantages(scored.rewards_NF)
        # Where groups span ranks, the groups' metrics are the whole rollout's (the same on every rank).
        every_NF = gather_rows(scored.rewards_NF, across_ranks(self.accelerator)) if args.groups_span_ranks else None
        metrics = scored_metrics(
            scored, self.reward_func_names, self.reward_weights, args.num_generations, self._vision, every_NF
        )
        self._record(metrics | logged)
        images = scored.images.images if scored.images is not None and args.log_multimodal else None
        self.log_completions(scored.prompts, scored.rollout, scored.rewards_NF, advantages_N, extra, images)
        pad_id = text_tokenizer(self.processing_class).pad_token_id
        per_prompt = 1 if args.groups_span_ranks else args.num_generations  # `sample`: one prompt per completion
        batch = rollout_batch(
            scored, advantages_N, per_prompt, pad_id, args.mask_truncated_completions, args.mask_stale_tokens
        )
        # dapo divides each slice by the completion tokens of all ranks' rollouts, per rank and slice.
        tokens = self.accelerator.gather(batch["completion_mask"].sum().to(args.device)).sum().float()
        batch["num_items"] = tokens / (self.accelerator.num_processes * args.steps_per_generation)
        # A slice may end inside a group: its advantages are the whole rollout's; sharing matches any prompt's rows.
        slices = split_rows(batch, args.steps_per_generation)
        with self._timed("logps"):
            for part in slices:
                part.update(self.rollout_logps(part))
        return slices

    def sample_dynamic(self, rows: list[dict]) -> tuple[ScoredRollout, int]:
        """One training rollout of dynamic sampling (`colograd.rollout.dynamic`): `sample` in rounds until every group
        kept is informative. Returns it, and the completion tokens generated (in every round, dropped groups too)."""
        sample = lambda rows, round: self.sample(rows, round=round)  # noqa: E731
        # One wake for every round: with sleep mode, each round's own would put the engine to sleep in between.
        with self.engine.awake():
            scored, metrics, dropped = self.dynamic.fill(
                rows,
                sample,
                self.reward_weights,
                largest_over_ranks(self.accelerator),
                self._run_micro_step(),
            )
        self._record(metrics)
        return scored, int(sampled_lengths(scored.rollout).sum()) + dropped

    def sample(
        self,
        rows: list[dict],
        num_generations: int | None = None,
        *,
        evaluation: bool = False,
        round: int = 0,
        counts: list[int] | None = None,
    ) -> ScoredRollout:
        """One rollout of `rows`, scored: the call training and evaluation share. Runs the stages
        `prepare_prompts`, `generate` and `score`, cuts the prompts to fit between the first two, and records no
        metric (the caller computes its own from what it returns).

        Args:
            rows: this rank's dataset rows.
            num_generations: completions per prompt; default `num_generations`, in evaluation
                `num_generations_eval` (when set).
            evaluation: an evaluation rollout: seeded apart from training's, and its phases timed as `eval_generate`
                and `eval_reward`, out of training's figures.
            round: a refill round of dynamic sampling (`colograd.rollout.dynamic`), seeded apart from the rollout's
                first.
            counts: where groups span ranks, how many completions of each row this rank samples
                (`colograd.rollout.spans`); the rollout returned then holds one prompt (and its columns) per
                completion.
        """
        args = self.args
        g = num_generations or (evaluation and args.num_generations_eval) or args.num_generations
        # Rows read for training carry their names (vision-language runs, `ROW_KEY`), for the messages of the checks
        # in `prepare_prompts`; an evaluation's are this rank's share of the eval dataset (`rank_share`).
        if evaluation and self._vision:
            world, rank = self.accelerator.num_processes, self.accelerator.process_index
            rows = named_rows(rows, "eval_dataset", range(rank, rank + world * len(rows), world))
        prepared = self.prepare_prompts(rows)
        prompts, prompt_ids, columns = prepared
        images = getattr(prepared, "images", None)  # an override's own tuple: text prompts
        rows, _ = row_names(rows)
        limit = self.prompt_limit
        cut = [len(ids) > limit for ids in prompt_ids]
        truncated = sum(cut)
        prompt_ids = [ids[-limit:] for ids in prompt_ids]
        step = -1 - self.state.global_step if evaluation else self._rollout_index() + round * ROUND_STRIDE
        asks, turn = gap_sampling(args, self.state, self.parity.comparing, evaluation)
        context = RolloutContext(rows, step, g, evaluation, round, gap_sample=asks, gap_turn=turn, counts=counts)
        prefix = "eval_" if evaluation else ""
        self._check_synced("sample")
        with self.engine.awake(), self._timed(f"{prefix}generate"):
            if images is None:
                rollout = self.generate(prompt_ids, context)
            else:
                rollout = self.generate(prompt_ids, context, images=images.images)
        if counts is not None:  # a share of groups that span ranks: one prompt per completion from here on
            check_share(len(rollout.completion_ids), counts)
            prompts, prompt_ids = per_completion(prompts, counts), per_completion(prompt_ids, counts)
            columns = {key: per_completion(values, counts) for key, values in columns.items()}
            truncated = sum(per_completion(cut, counts))
        with self._timed(f"{prefix}reward"):
            rewards_NF = self.score(prompts, rollout, columns)
        return ScoredRollout(prompts, prompt_ids, columns, rollout, rewards_NF, truncated, images)

    def sample_partial(self, rows: list[dict]) -> tuple[ScoredRollout, int]:
        """One training rollout of partial rollouts (`colograd.rollout.partial`): the groups carried from the last
        rollout continued first, then `rows` and the extra prompts that keep the groups in flight; the first
        `len(rows)` finished groups, in that order, scored. Returns it, and the completion tokens generated (in every
        group)."""
        partial, want = self.partial, len(rows)
        version = self.state.global_step  # the weights' version: the optimizer step they are from (kept on resume)
        dropped = partial.drop_stale(version)
        rows = rows + partial.extra_rows(want, self._run_micro_step())
        _, prompt_ids, _ = self.prepare_prompts(rows)
        limit = self.prompt_limit
        cut = [len(ids) > limit for ids in prompt_ids]
        self._check_synced("sample_partial")
        with self.engine.awake(), self._timed("generate"):
            groups, metrics, generated = partial.take(
                self.engine, rows, [ids[-limit:] for ids in prompt_ids], want, version, cut
            )
        self._record(metrics | {"partial_rollouts/dropped_groups": float(dropped)})
        # The taken groups' prompts and columns for the rewards, through the stage again (an override's, if any): they
        # may come from earlier rollouts. (It tokenizes their prompts again: a batch of prompts, once per rollout.)
        prompts, _, columns = self.prepare_prompts([group.row for group in groups])
        rollout = partial.rollout(groups, version)
        with self._timed("reward"):
            rewards_NF = self.score(prompts, rollout, columns)
        prompt_ids = [group.prompt_ids for group in groups]
        truncated = sum(group.prompt_truncated for group in groups)
        return ScoredRollout(prompts, prompt_ids, columns, rollout, rewards_NF, truncated), generated

    def _run_micro_step(self) -> int:
        """The micro-step the run is at, counted from its start (the same after a resume, which starts at an optimizer
        step)."""
        accumulation = self.args.gradient_accumulation_steps
        return self.state.global_step * accumulation + self._micro_step % accumulation

    def _rollout_index(self) -> int:
        """The training rollout's place in the run (its first micro-step's), which seeds its sampling."""
        return self.state.global_step * self.args.gradient_accumulation_steps + self._micro_step

    @property
    def prompt_limit(self) -> int:
        """The most prompt tokens a rollout keeps (the last ones): `max_prompt_length`, or as many as the engine's
        context leaves room for beside a whole completion, whichever is fewer."""
        return min(self.args.max_prompt_length or self.engine.max_prompt_tokens, self.engine.max_prompt_tokens)

    def sync_for_rollout(self) -> None:
        """A rollout's first phase, training's (`make_rollout`) and evaluation's: the engine's weights memory back
        (sleep mode; it stays for the generation, whose `Engine.awake` brings back the KV cache) and the last
        optimizer step's weights written into it (`sync_weights`)."""
        self.engine.wake_weights()
        self.sync_weights()

    def _check_synced(self, stage: str) -> None:
        """Refuse a rollout's generation on weights other than the last optimizer step's (an override of
        `make_rollout` that skipped its first phase would train on samples of older weights, silently)."""
        if not self.engine.holds(self.state.global_step):
            raise RuntimeError(
                f"GRPOTrainer.{stage}: the engine does not hold the last optimizer step's weights; a rollout starts "
                "by writing them (`self.sync_for_rollout()`, as `make_rollout` and evaluation do)."
            )

    def sync_weights(self) -> None:
        """Write the model's weights into the engine, once per optimizer step (not per accumulation step), and again
        whenever the engine dropped them (sleep mode): `Engine.sync`, which also wakes an engine asleep between
        rollouts for the write."""
        self.engine.sync(self._write_weights, self.state.global_step)

    def _write_weights(self) -> None:
        """The weight sync itself: the model's weights through its `WeightPlan` (built at the first sync, once
        accelerate / DeepSpeed have wrapped and maybe sharded the model)."""
        if self.weight_plan is None:
            model = self.accelerator.unwrap_model(self.model)
            self.weight_plan = weight_plan(model, self.args.sync_bucket_mib, self.inputs.lora_rank)
        with self._timed("sync"):
            self.weight_plan.sync(self.engine)

    def prepare_prompts(self, rows: list[dict], tools: list[dict] | None = None) -> PreparedPrompts:
        """Template and tokenize a batch of dataset rows. A vision-language run's rows are each checked first
        (`check_row`, as preflight checks its sample), so a bad row stops the rollout before any work on it.

        Args:
            rows: this rank's dataset rows; rows read for a vision-language run carry their names
                ("train_dataset row 300", `colograd.data.streaming.ROW_KEY`) for the checks' messages.
            tools: the tool schemas the chat template is given; None: the run's (every tool's, and with several
                environments every environment's). An environment's prompts are templated with its own
                (`colograd.agents.core.Agents`).

        Returns:
            `(prompts, prompt_ids, columns)` (a `PreparedPrompts`):
            prompts: the `prompt` of each row, as given (text or messages), for the reward functions.
            prompt_ids: token ids of each templated prompt, whole (`sample` keeps the last `prompt_limit`).
            columns: every other column, one value per row.
            An image rollout's also carries its images, expanded ids and pixels (`.images`), which `sample` hands
            to `generate` and returns with the rollout.
        """
        rows, names = row_names(rows)
        prompts = [row["prompt"] for row in rows]
        columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
        names = names or [f"the rollout's prompt {k}" for k in range(len(rows))]
        if self._vision:
            limit, most = self.prompt_limit, self.inputs.images_per_prompt
            prepared = vision_prompts(self.processing_class, rows, names, columns, most, limit, self.args)
            if prepared is not None:
                return prepared
        prompt_ids = tokenize_prompts(
            prompts, self.processing_class, tools or self._tool_schemas(), self.args.chat_template_kwargs
        )
        return PreparedPrompts(prompts, prompt_ids, columns)

    def generate(
        self, prompt_ids: list[list[int]], context: RolloutContext, images: list[list] | None = None
    ) -> Rollout:
        """`context.num_generations` completions of every prompt of this rank, in one engine call; with tools,
        environments or a `rollout_func`, through `colograd.agents.core`. Reward functions marked for it start on each
        prompt's completions as soon as they are sampled (`colograd.rewards.early`).

        Args:
            prompt_ids: each prompt's token ids, cut to `prompt_limit`.
            context: the rollout's rows, seed step, G and kind (`RolloutContext`), from `sample`.
            images: an image rollout's images, each prompt's, which `sample` passes from `prepare_prompts`.
        """
        g, rows = context.num_generations, context.rows
        early = early_rewards(self.reward_funcs)
        chats = bool(rows) and is_conversational({"prompt": rows[0]["prompt"]})
        on_group = group_starter(early, self.processing_class, rows, chats) if early and rows else None
        if self.agents is not None:
            return self.agents.generate(self, prompt_ids, context, on_group)
        # The engine asks the sampling-gap metric's log-probs of its first prompt's first completion: an image run
        # puts another of its prompts first at each rollout that asks (`context.gap_turn`), so that the metric covers
        # every row in turn (the same requests, at no cost); `sampling_gap_completions: all` asks every completion.
        shift = 0
        if images is not None and context.gap_sample and not self.args.needs_engine_logps:
            shift = context.gap_turn % len(prompt_ids)
        return rotate_prompts(
            lambda ids, imgs, report: self.engine.generate(
                ids,
                Sampling.of(self.args),
                step=context.step,
                num_generations=g,
                gap_sample=context.gap_sample,
                on_group=report,
                images=imgs,
                counts=context.counts,
            ),
            prompt_ids,
            images,
            on_group,
            shift,
            g,
        )

    def score(self, prompts: list, rollout: Rollout, columns: dict[str, list]) -> torch.Tensor:
        """Rewards of every completion from every reward function: [N, F], NaN where a function abstained. What the
        functions log (TRL's `log_extra` / `log_metric`) goes into `rollout.reward_logs`."""
        given = {"trainer_state": self.state, **rollout.reward_logs.arguments()}
        limits = TimeLimits.of(self.args)
        return score_rollout(self.reward_funcs, self.processing_class, prompts, rollout, columns, given, limits)

    def compute_advantages(self, rewards_NF: torch.Tensor) -> torch.Tensor:
        """Weighted total reward per completion, normalised within its group: [N]. Where groups span ranks, computed
        over every rank's rewards, this rank's slice kept (`spanned_advantages`)."""
        args, gather = self.args, across_ranks(self.accelerator)
        g, weights = args.num_generations, self.reward_weights

        def advantages(rewards_NF: torch.Tensor, gather: Gather | None) -> torch.Tensor:
            if args.multi_objective_aggregation == "normalize_then_sum":
                return normalize_then_sum(rewards_NF, weights, g, gather)
            return group_advantages(weighted_rewards(rewards_NF, weights), g, args.scale_rewards, gather)

        if args.groups_span_ranks:
            return spanned_advantages(advantages, rewards_NF, gather, self.accelerator.process_index)
        return advantages(rewards_NF, gather)

    @torch.no_grad()
    def rollout_logps(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        """Log-probs a rollout slice needs besides the current ones, computed once when it is generated.

        Returns:
            `old_logps` [N, T] (the policy that sampled) when a slice is trained after an optimizer step: the
            engine's own log-probs of its samples when they serve (one pass over the rollout, unfiltered
            sampling), else the trainer's, by a forward pass;
            `ref_logps` [N, T] (the reference policy) when `beta` > 0.
        """
        out, args = {}, self.args
        policy = self.accelerator.unwrap_model(self.model)
        trainer_logps = lambda: self.completion_logps(policy, batch)  # noqa: E731
        with self.compute_loss_context_manager():
            if args.reuses_rollouts_across_updates and args.engine_logps_are_old_logps:
                out["old_logps"] = engine_old_logps(batch["engine_logps"], trainer_logps)
            elif args.reuses_rollouts_across_updates:
                out["old_logps"] = trainer_logps()
                self._record(sampling_gap_metrics(out["old_logps"], batch["engine_logps"], batch["tool_mask"]))
            if self.reference is not None:
                with self.reference.model(policy) as reference:
                    out["ref_logps"] = self.completion_logps(reference, batch)
        return out

    def compute_loss(
        self,
        model: nn.Module,
        inputs: RolloutBatch,
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """The GRPO loss of one rollout slice. The old log-probs are the stored ones when the slice is trained
        after an optimizer step, else the current ones detached (ratio 1, gradient not)."""
        args, mask_NT = self.args, inputs["completion_mask"]
        forwarded: list[int] = []  # tokens computed: fewer than the sequences' when completions share a prompt
        routed = RouterRecord(self.forward.router) if self.forward.router is not None and model.training else None
        # The trainer's log-probs, measured against the engine's on a rollout's first slice (`ParityGuard.measured`).
        logps_NT, entropy_NT = self.parity.measured(
            model,
            inputs,
            lambda: self.completion_logps(model, inputs),
            lambda: self.completion_logps(
                model, inputs, entropy=self.entropy.mode, count_tokens=forwarded.append, router=routed
            ),
        )
        if model.training:
            trained = inputs["attention_mask"].sum().item()
            self._times.count("trained", trained, self.metrics)
            self._times.count("forwarded", forwarded[0] if forwarded else trained, self.metrics)
        # On-policy, and on a rollout's first slice, the current weights are the ones that sampled. (When old
        # log-probs come from a forward pass, `rollout_logps` logged the gap for every slice already.)
        fresh = bool(inputs["fresh"]) if "fresh" in inputs else False
        if "old_logps" not in inputs or (fresh and args.engine_logps_are_old_logps):
            self._record(sampling_gap_metrics(logps_NT.detach(), inputs["engine_logps"], inputs["tool_mask"]))
        sampling_weights = None
        if args.vllm_importance_sampling_correction:  # truncated π_trainer / π_engine of the sampled tokens
            # The trainer's log-probs of the sampling policy: stored with the rollout, or, on-policy, the current.
            trainer_NT, modes = inputs.get("old_logps", logps_NT.detach()), importance_sampling(args)
            sampling_weights = sampling_correction(trainer_NT, inputs["engine_logps"], mask_NT, *modes)
            self._record(importance_ratio_metrics(sampling_weights, mask_NT))
        entropy_mask_NT = self.entropy.mask(entropy_NT, mask_NT)
        out = policy_loss(
            logps_NT,
            inputs.get("old_logps", logps_NT.detach()),
            inputs["advantages"],
            mask_NT,
            ref_logps_NT=inputs.get("ref_logps"),
            num_items=inputs["num_items"],
            sampling_weights=sampling_weights,
            sampling_logps_NT=inputs.get("engine_logps"),
            entropy_mask_NT=entropy_mask_NT,
            **objective(self.args),
        )
        loss = self.entropy.regularize(out.loss, entropy_NT, mask_NT, entropy_mask_NT, model.training)
        if routed is not None:  # TRL's router loss, and the experts' load
            loss = loss + routed.loss()
            self._record(routed.metrics())
        if self.forward.replay is not None and model.training:  # the routing of the passes since the last slice
            self._record(self.forward.replay.take())
        out = out._replace(loss=loss * inputs["loss_scale"] if "loss_scale" in inputs else loss)  # micro_batch_tokens
        self._record(loss_metrics(out, inputs["advantages"], mask_NT, args.epsilon, args.epsilon_high))
        return out.loss

    def completion_logps(
        self,
        model: nn.Module,
        inputs: RolloutBatch,
        entropy: str | None = None,
        count_tokens: Callable[[int], None] | None = None,
        router: RouterRecord | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the completion tokens under `model` at the sampling temperature, [N, T], and with `entropy`
        ("detached" / "grad") each position's entropy, as the run's forward pass computes them (`Forward.logps`)."""
        return self.forward.logps(model, inputs, entropy, count_tokens, router)

    # --- evaluation -------------------------------------------------------------------------------------

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Sample `num_generations_eval` completions of every eval prompt with the engine, in one call per rank,
        and score them with the reward functions; logs and returns TRL's eval metrics
        (`colograd.rollout.evaluation`)."""
        metrics = evaluate(self, eval_dataset if eval_dataset is not None else self.eval_dataset)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _tool_schemas(self) -> list[dict] | None:
        """The run's tool schemas, which the chat template is given unless `prepare_prompts` is passed others (`or
        None`: some templates write tool text for an empty list)."""
        return (self.agents.schemas or None) if self.agents is not None else None
