"""`GRPOTrainer`: transformers' `Trainer` with a colocated engine, one small method per GRPO stage.

A training step on each rank:

    sync_weights       if the optimizer stepped since the last rollout, write the weights into the engine
    prepare_prompts    template, tokenize and truncate this rank's B prompts
    generate           one engine call: B prompts × G completions (n=G shares each prompt's prefill)
    score              reward functions, in this rank
    compute_advantages per group, in this rank: a rank owns whole groups, so nothing is gathered
    compute_loss       GRPO clipped policy-gradient loss; backward and optimizer step are the Trainer's

Subclass and override one of these to change that stage alone.
"""

import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase, Trainer
from trl.data_utils import is_conversational, maybe_apply_chat_template
from trl.trainer.utils import selective_log_softmax

from colograd.checkpoints import checkpoint_step, resolve_checkpoint
from colograd.completions import CompletionLog
from colograd.config import ConfigError, GRPOConfig
from colograd.engine import Engine, Rollout
from colograd.loss import group_advantages, policy_loss
from colograd.modelcard import Recipe, model_card, write_model_card
from colograd.rewards import RewardFunc, resolve_reward, reward_name, score
from colograd.sync import sync_weights


def _keep_rows(features: list[dict]) -> list[dict]:
    """The data collator: a batch stays a list of dataset rows; tokenization happens per rollout."""
    return features


class GRPOTrainer(Trainer):
    """Group Relative Policy Optimization with a vLLM engine inside each training process.

    Args:
        model: a causal LM, or a hub id / local path to load one from.
        reward_funcs: reward functions (TRL's signature) or their names (see `colograd.rewards`).
        args: the run's configuration; defaults to `GRPOConfig(output_dir="colograd-output")`.
        train_dataset: rows with a `prompt` column (text, or chat messages); other columns reach the rewards.
        processing_class: the tokenizer; loaded from `model`'s path when omitted.
        callbacks: extra `TrainerCallback`s.
        recipe: the recipe a command-line run was launched from, for the model card.
    """

    def __init__(
        self,
        model: PreTrainedModel | str,
        reward_funcs: RewardFunc | str | list[RewardFunc | str],
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        recipe: Recipe | None = None,
    ) -> None:
        args = args or GRPOConfig(output_dir="colograd-output")
        if isinstance(model, str):
            model = AutoModelForCausalLM.from_pretrained(model)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path)
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        if not isinstance(reward_funcs, list):
            reward_funcs = [reward_funcs]
        self.reward_funcs = [resolve_reward(f) if isinstance(f, str) else f for f in reward_funcs]
        if args.reward_weights is not None and len(args.reward_weights) != len(self.reward_funcs):
            raise ConfigError(
                f"reward_weights has {len(args.reward_weights)} values for {len(self.reward_funcs)} reward "
                "functions; give one weight per function."
            )
        weights = args.reward_weights or [1.0] * len(self.reward_funcs)
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)

        super().__init__(
            model=model,
            args=args,
            data_collator=_keep_rows,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            raise ConfigError("DeepSpeed ZeRO-3 is not supported yet; use ZeRO-2 or DDP.")
        if self.is_fsdp_enabled:
            raise ConfigError("FSDP is not supported yet; launch with DDP or DeepSpeed ZeRO-2 instead.")
        # compute_loss returns a per-micro-batch mean; the Trainer divides it by the accumulation steps.
        self.model_accepts_loss_kwargs = False
        # Built after super().__init__: the torch process group must exist before the engine joins it.
        self.engine = Engine(self.accelerator.unwrap_model(self.model), processing_class, args)
        self._synced_step: int | None = None  # the global_step whose weights the engine holds
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._last_logged_step = 0
        self.recipe = recipe
        self._completion_log = (
            CompletionLog(args.output_dir, args.num_completions_to_print)
            if args.log_completions and self.accelerator.is_main_process
            else None
        )

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """transformers' `train`. `resume_from_checkpoint=True` takes the newest *finished* checkpoint of
        `output_dir` (see `colograd.checkpoints`); a named one must be finished too."""
        checkpoint = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        # The model is about to change (restored, or trained on from here): the first rollout re-syncs.
        self._synced_step = None
        # The first logging window starts where the run (re)starts: time/* are divided by its steps.
        self._last_logged_step = checkpoint_step(checkpoint) if checkpoint else 0
        if checkpoint and self._completion_log is not None:
            self._completion_log.forget_after(self._last_logged_step)
        return super().train(resume_from_checkpoint=checkpoint, **kwargs)

    # --- data -------------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """Batches of whole prompts: each rank takes `per_device_train_batch_size / num_generations` of them."""
        if self.train_dataset is None:
            raise ValueError("GRPOTrainer: training requires a train_dataset.")
        return self._get_dataloader(
            dataset=self.train_dataset,
            description="Training",
            batch_size=self.args.prompts_per_device,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    # --- the step ---------------------------------------------------------------------------------------

    def training_step(
        self, model: nn.Module, inputs: list[dict], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """One micro-step: a rollout from this rank's prompts, then the Trainer's forward/backward on it."""
        self.sync_weights()
        prompts, prompt_ids, columns = self.prepare_prompts(inputs)
        with self._timed("generate"):
            rollout = self.generate(prompt_ids)
        with self._timed("reward"):
            rewards_NF = self.score(prompts, rollout, columns)
        advantages_N = self.compute_advantages(rewards_NF)
        self.log_completions(prompts, rollout, rewards_NF, advantages_N)
        batch = self._to_tensors(prompt_ids, rollout, advantages_N)
        with self._timed("train"):
            return super().training_step(model, batch, num_items_in_batch)

    def sync_weights(self) -> None:
        """Write the model's weights into the engine, once per optimizer step (not per accumulation step)."""
        if self._synced_step == self.state.global_step:
            return
        with self._timed("sync"):
            sync_weights(self.accelerator.unwrap_model(self.model), self.engine)
        self._synced_step = self.state.global_step

    def prepare_prompts(self, rows: list[dict]) -> tuple[list, list[list[int]], dict[str, list]]:
        """Template and tokenize a batch of dataset rows.

        Returns:
            prompts: the `prompt` of each row, as given (text or messages), for the reward functions.
            prompt_ids: token ids of each templated prompt, keeping the last `max_prompt_length`.
            columns: every other column, one value per row.
        """
        prompts = [row["prompt"] for row in rows]
        texts = [maybe_apply_chat_template({"prompt": p}, self.processing_class)["prompt"] for p in prompts]
        prompt_ids = self.processing_class(text=texts, add_special_tokens=False)["input_ids"]
        limit = self.args.max_prompt_length
        if limit is not None:
            self._metrics["prompts/truncated_ratio"].append(sum(len(p) > limit for p in prompt_ids) / len(prompt_ids))
            prompt_ids = [p[-limit:] for p in prompt_ids]
        columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
        return prompts, prompt_ids, columns

    def generate(self, prompt_ids: list[list[int]]) -> Rollout:
        """All G completions of every prompt of this rank, in one engine call."""
        rollout = self.engine.generate(prompt_ids, self.args)
        lengths = torch.tensor([len(c) for c in rollout.completion_ids], dtype=torch.float32)
        self._metrics["completions/mean_length"].append(lengths.mean().item())
        self._metrics["completions/min_length"].append(lengths.min().item())
        self._metrics["completions/max_length"].append(lengths.max().item())
        self._metrics["completions/clipped_ratio"].append(sum(rollout.truncated) / len(rollout.truncated))
        return rollout

    def score(self, prompts: list, rollout: Rollout, columns: dict[str, list]) -> torch.Tensor:
        """Rewards of every completion from every reward function: [N, F], NaN where a function abstained."""
        g = self.args.num_generations
        texts = self.processing_class.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        conversational = is_conversational({"prompt": prompts[0]})
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        repeat = lambda values: [v for v in values for _ in range(g)]  # noqa: E731 — one value per completion
        rewards_NF = score(
            self.reward_funcs,
            prompts=repeat(prompts),
            completions=completions,
            completion_ids=rollout.completion_ids,
            columns={**{k: repeat(v) for k, v in columns.items()}, "trainer_state": self.state},
        )
        for j, func in enumerate(self.reward_funcs):
            self._metrics[f"rewards/{reward_name(func)}/mean"].append(torch.nanmean(rewards_NF[:, j]).item())
        return rewards_NF

    def compute_advantages(self, rewards_NF: torch.Tensor) -> torch.Tensor:
        """Weighted total reward per completion, normalised within its group: [N]."""
        g = self.args.num_generations
        rewards_N = (rewards_NF * self.reward_weights).nansum(dim=1)
        group_std_G = rewards_N.view(-1, g).std(dim=1)
        self._metrics["reward"].append(rewards_N.mean().item())
        self._metrics["reward_std"].append(group_std_G.mean().item())
        self._metrics["frac_reward_zero_std"].append((group_std_G < 1e-6).float().mean().item())
        return group_advantages(rewards_N, g, self.args.scale_rewards)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """The GRPO loss of one rollout. With one update per rollout the policy that sampled is the one being
        trained, so the old log-probs are the current ones, detached (the ratio is 1, its gradient is not)."""
        mask_NT = inputs["completion_mask"]
        logps_NT = self.completion_logps(model, inputs)
        engine_logps_NT = inputs["engine_logps"]
        # How far the engine's sampling distribution is from the trainer's: ~0 when the sync is exact.
        # Over every sampled token, masked or not: each completion has at least one, so `diff` is never empty.
        sampled_NT = inputs["attention_mask"][:, -logps_NT.size(1) :].bool()
        diff = (logps_NT.detach() - engine_logps_NT).abs()[sampled_NT]
        self._metrics["sampling/sampling_logp_difference/mean"].append(diff.mean().item())
        self._metrics["sampling/sampling_logp_difference/max"].append(diff.max().item())
        return policy_loss(
            logps_NT,
            logps_NT.detach(),
            inputs["advantages"],
            mask_NT,
            loss_type=self.args.loss_type,
            epsilon_low=self.args.epsilon,
            epsilon_high=self.args.epsilon_high,
            max_completion_length=self.args.max_completion_length,
            num_items=inputs["num_items"],
        )

    def completion_logps(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Log-probs of the completion tokens under `model`, at the sampling temperature: [N, T]."""
        completion_ids_NT = inputs["completion_ids"]
        t = completion_ids_NT.size(1)
        # Only the last T+1 positions' logits are computed: the prompt's own logits are never needed.
        logits_NTV = model(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            position_ids=inputs["position_ids"],
            logits_to_keep=t + 1,
        ).logits[:, :-1]
        return selective_log_softmax(logits_NTV / self.args.temperature, completion_ids_NT)

    def log_completions(
        self, prompts: list, rollout: Rollout, rewards_NF: torch.Tensor, advantages_N: torch.Tensor
    ) -> None:
        """With `log_completions`, hand the first rank's rollout to the completion log every
        `log_completions_steps` (every logging step when unset)."""
        step = self.state.global_step + 1  # the optimizer step this rollout trains, as logs number it
        if self._completion_log is None or step % (self.args.log_completions_steps or self.state.logging_steps):
            return
        texts = self.processing_class.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        rewards = {reward_name(f): rewards_NF[:, j].tolist() for j, f in enumerate(self.reward_funcs)}
        total_N = (rewards_NF * self.reward_weights).nansum(dim=1)
        self._completion_log.record(step, prompts, texts, rewards, total_N.tolist(), advantages_N.tolist())

    # --- saving -----------------------------------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Every save of the model (final, checkpoint, before a push) writes its model card beside it.
        The Trainer calls this on the saving process only."""
        super()._save(output_dir, state_dict)
        self.create_model_card(output_dir=output_dir)

    def create_model_card(
        self,
        model_name: str | None = None,
        tags: str | list[str] | None = None,
        finetuned_from: str | None = None,
        output_dir: str | None = None,
    ) -> None:
        """Write `README.md` (see `colograd.modelcard`) into `output_dir` (default `args.output_dir`).

        `push_to_hub` calls this before uploading, with the repository's name as `model_name`.
        """
        output_dir = output_dir or self.args.output_dir
        base = finetuned_from or (self.recipe and self.recipe.model_name_or_path) or self.model.config._name_or_path
        card = model_card(
            model_name=model_name or os.path.basename(os.path.normpath(self.args.output_dir)),
            base_model=base,
            recipe=self.recipe,
            log_history=self.state.log_history,
            world_size=self.args.world_size,
            tags=[tags] if isinstance(tags, str) else tags,
        )
        write_model_card(card, output_dir)

    # --- plumbing ---------------------------------------------------------------------------------------

    def _to_tensors(
        self, prompt_ids: list[list[int]], rollout: Rollout, advantages_N: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Pad the rollout into the tensors `compute_loss` reads: prompts left-padded, completions right-padded."""
        g, pad = self.args.num_generations, self.processing_class.pad_token_id
        completions = rollout.completion_ids
        n, p, t = len(completions), max(map(len, prompt_ids)), max(1, max(map(len, completions)))
        input_ids = torch.full((n, p + t), pad, dtype=torch.long)
        attention_mask = torch.zeros((n, p + t), dtype=torch.long)
        engine_logps = torch.zeros((n, t))
        for i, (ids, logps) in enumerate(zip(completions, rollout.logps, strict=True)):
            prompt = prompt_ids[i // g]
            input_ids[i, p - len(prompt) : p] = torch.tensor(prompt)
            input_ids[i, p : p + len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, p - len(prompt) : p + len(ids)] = 1
            engine_logps[i, : len(logps)] = torch.tensor(logps)
        completion_mask = attention_mask[:, p:].clone()
        if self.args.mask_truncated_completions:
            completion_mask[torch.tensor(rollout.truncated)] = 0
        # dapo divides by the completion tokens of all ranks' rollouts, per rank: one scalar all-reduce.
        num_items = self.accelerator.gather(completion_mask.sum().to(self.args.device)).sum().float()
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
            "completion_ids": input_ids[:, p:],
            "completion_mask": completion_mask,
            "engine_logps": engine_logps,
            "advantages": advantages_N,
            "num_items": num_items / self.accelerator.num_processes,
        }

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self._metrics[f"time/{phase}"].append(time.perf_counter() - start)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add this window's GRPO metrics, averaged over micro-steps and ranks (max over ranks for `*/max`).

        `time/*` are seconds per optimizer step: their sums over the window divided by its steps.
        """
        if self._metrics and "loss" in logs:
            steps = max(1, self.state.global_step - self._last_logged_step)
            names = sorted(self._metrics)
            values = [
                sum(self._metrics[k]) / (steps if k.startswith("time/") else len(self._metrics[k])) for k in names
            ]
            local = torch.tensor(values, device=self.args.device)
            mean = self.accelerator.reduce(local.clone(), reduction="mean")
            high = self.accelerator.gather(local.unsqueeze(0)).amax(dim=0)
            is_max = torch.tensor([k.endswith("/max") for k in names], device=self.args.device)
            logs.update(zip(names, torch.where(is_max, high, mean).tolist(), strict=True))
            self._metrics.clear()
            self._last_logged_step = self.state.global_step
        super().log(logs, start_time)
