"""Saving and resuming a run: every save of the model writes its model card beside it, every checkpoint carries a
record (`colograd.runs.checkpoints`) that says whether it finished and what run saved it, and a resume takes only such
a checkpoint of this run.

`ModelSaving` holds transformers' `Trainer` save hooks as colograd overrides them; `GRPOTrainer` inherits them.
"""

import os
from typing import Any

from torch import nn
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from colograd.runs import universal
from colograd.runs.checkpoints import (
    begin_record,
    check_resume,
    check_setup,
    finish_record,
    note,
    recorded_setup,
    rotate_checkpoints,
    run_setup,
)
from colograd.runs.model_load import load_model_weights, saved_names
from colograd.runs.modelcard import model_card, write_model_card
from colograd.runs.output_dir import check_output_dir
from colograd.runs.preemption import stage_failures
from colograd.runs.relaunch import reshard_note


def push_output_dir(args: Any) -> str:
    """What `push_to_hub` uploads at a run's end, for a run finished from its last checkpoint, where no trainer is
    built (`colograd.runs.output_dir.RunFinished`): output_dir less its checkpoints and `_` files, as transformers'
    `Trainer.push_to_hub` leaves them out, to `hub_model_id` (default: the folder's name under the token's user), on
    `hub_revision` (created from the default branch where missing).

    Returns:
        The repository's id.
    """
    from huggingface_hub import HfApi

    api = HfApi(token=args.hub_token)
    name = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
    repo = api.create_repo(name, private=args.hub_private_repo, exist_ok=True).repo_id
    if args.hub_revision not in (None, "main"):
        api.create_branch(repo, branch=args.hub_revision, exist_ok=True)
    api.upload_folder(
        repo_id=repo, folder_path=args.output_dir, commit_message="End of training", revision=args.hub_revision,
        ignore_patterns=["_*", f"{PREFIX_CHECKPOINT_DIR}-*"],
    )  # fmt: skip
    return repo


class ModelSaving(Trainer):
    """The save hooks of `GRPOTrainer` and where a `train` call starts from (`recipe`, `reward_func_names` and
    `reward_weights` are set by it)."""

    # Objects with a `write_state(folder)` of their own state, written into each checkpoint before its record says
    # the save finished, so that a finished checkpoint always holds it (the trainer's: the entropy coefficient).
    checkpoint_parts: tuple = ()
    # The same for state each rank holds for itself (the groups partial rollouts carry): every rank writes its own.
    rank_checkpoint_parts: tuple = ()

    def init_hf_repo(self, token: str | None = None) -> None:
        """transformers' repository set-up for `push_to_hub`, and the branch `hub_revision` names (open-r1's
        `hub_model_revision`) created from the default branch where missing, as open-r1's callback creates it:
        transformers pushes to the branch but never makes it."""
        super().init_hf_repo(token)
        if self.args.hub_revision not in (None, "main") and self.is_world_process_zero():
            from huggingface_hub import HfApi

            token = token if token is not None else self.args.hub_token
            HfApi().create_branch(self.hub_model_id, branch=self.args.hub_revision, token=token, exist_ok=True)

    def resume_point(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """The checkpoint a `train` call resumes from, or None: the newest finished one for True, a named one only
        if finished; either saved by a run set up as this one (`check_setup`). None (not given) with `auto_resume`:
        this run's own newest finished checkpoint, if any (`colograd.runs.relaunch`). A run that resumes nothing is
        refused where another run's work is (`colograd.runs.output_dir`)."""
        policy = self.accelerator.unwrap_model(self.model)
        self.run_setup = run_setup(
            self.args, policy, (self.recipe and self.recipe.model_name_or_path) or policy.config._name_or_path,
            self.train_dataset, self.reward_func_names, self.reward_weights.tolist(),
        )  # fmt: skip
        # The first process decides and acts (it may remove this run's unfinished saves); the others judge after it,
        # never a folder it is removing.
        with self.accelerator.main_process_first():
            checkpoint = check_output_dir(self.args, resume_from_checkpoint, self.run_setup)
        if checkpoint:
            check_resume(checkpoint, self.args, policy.config, self.args.trust_remote_code)
            check_setup(checkpoint, self.run_setup)  # another number of ranks passes where the run's batch is kept
            if line := reshard_note(checkpoint, self.run_setup):
                note(line)
                if self.run_setup["sharding"] == "deepspeed":
                    self._load_universal(checkpoint)
        return checkpoint

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """A model saved whole in safetensors is loaded every tensor, through the conversions `from_pretrained`
        applies where the checkpoint's names are not the model's (`colograd.runs.model_load`); an adapter, FSDP's
        files and PyTorch's `.bin` as transformers loads them."""
        model = model if model is not None else self.model
        names = self._saved_whole(resume_from_checkpoint, model)
        if names is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        else:
            load_model_weights(model, resume_from_checkpoint, names)

    def _load_best_model(self) -> None:
        """`load_best_model_at_end`'s load, every tensor as a resume's (`_load_from_checkpoint`)."""
        checkpoint = self.state.best_model_checkpoint
        names = self._saved_whole(checkpoint, self.model)
        if names is None:
            super()._load_best_model()
        else:
            note(f"loading the best model, from {checkpoint}")
            load_model_weights(self.model, checkpoint, names)

    def _saved_whole(self, checkpoint: str, model: nn.Module) -> set[str] | None:
        """The names of `checkpoint`'s model where colograd loads it (saved whole in safetensors, not an adapter,
        not under DeepSpeed or FSDP, which load their own files), else None: transformers' own load."""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or hasattr(model, "peft_config"):
            return None
        return saved_names(checkpoint)

    def _load_universal(self, checkpoint: str) -> None:
        """A DeepSpeed checkpoint resumed on another number of ranks loads as DeepSpeed's universal checkpoint
        (`colograd.runs.universal`), converted once by the main process while the others wait."""
        if self.accelerator.is_main_process:
            universal.convert(checkpoint, saved=recorded_setup(checkpoint)["world_size"])
        self.accelerator.wait_for_everyone()
        universal.load_universal(self.accelerator.state.deepspeed_plugin.deepspeed_config)
        if not any(isinstance(c, universal.SeparateSteps) for c in self.callback_handler.callbacks):
            self.add_callback(universal.SeparateSteps())

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Every save of the model (final, checkpoint, before a push) writes its model card beside it; a failure (a
        full disk) names the step and the stage 'save'. The Trainer calls this on the saving process only."""
        with stage_failures("save", self.state.global_step, self.args.output_dir):
            super()._save(output_dir, state_dict)
            self.create_model_card(output_dir=output_dir)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """transformers' checkpoint save, bracketed by its record (`colograd.runs.checkpoints`): marked unfinished
        before anything is written, finished once every rank's part is. Older checkpoints are deleted only then
        (`save_total_limit`), so a save cut short never costs the last finished one. A failure names the step and
        the stage 'save'."""
        step, run_dir = self.state.global_step, self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        with stage_failures("save", step, self.args.output_dir):
            if self.args.should_save:
                begin_record(folder, self.run_setup)
            self.accelerator.wait_for_everyone()  # no rank writes into the folder before it is marked
            limit, self.args.save_total_limit = self.args.save_total_limit, None  # no rotation inside the save
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self.args.save_total_limit = limit
            if self.args.should_save:
                for part in self.checkpoint_parts:  # colograd's own state, inside the bracket too
                    part.write_state(folder)
            for part in self.rank_checkpoint_parts:  # each rank's own (`rank_checkpoint_parts`)
                part.write_state(folder)
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                finish_record(folder, self.run_setup)
                rotate_checkpoints(run_dir, limit, self.state.best_model_checkpoint)

    def create_model_card(
        self,
        model_name: str | None = None,
        tags: str | list[str] | None = None,
        finetuned_from: str | None = None,
        output_dir: str | None = None,
    ) -> None:
        """Write `README.md` (see `colograd.runs.modelcard`) into `output_dir` (default `args.output_dir`).

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
