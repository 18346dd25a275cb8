"""Why the engine and the trainer disagree, said in the parity gate's line: the sync, or the engine's model itself.

When the gate or the running guard stops a run (`colograd.grpo.parity`), the gap alone does not say which side is
wrong. A fresh load does: vLLM's own loader writes the trainer's weights, as `save_pretrained` would save them, into a
new instance of the engine's model class, and the engine's tensors are compared with it one by one
(`colograd.engine.fresh`).

- **Some differ**: the engine does not hold what a freshly loaded engine would. The sync leaves those tensors stale
  (a buffer it does not send, a tensor a reload path drops); the line names them.
- **Only tensors vLLM's loader never writes differ** (left NaN in the fresh instance, whose parameters start so):
  vLLM's model keeps its start-up values there whatever a checkpoint or a sync holds (vLLM 0.32's Laguna, its
  router's correction bias); the line says vLLM's model is at fault.
- **None differ**: the engine holds exactly what a fresh engine would, and still computes another distribution: vLLM's
  model of the architecture differs from transformers' (or the trainer's forward from the model's own). No sync can
  fix that; the line says so and what to try.

The comparison needs the whole weights on every rank: under DeepSpeed ZeRO-3 or FSDP it is not made, and the line
says so.
"""

from collections.abc import Callable

import torch
from peft import PeftModel
from torch import nn

from colograd.engine import fresh
from colograd.engine.core import Engine
from colograd.engine.sync import WeightPlan, is_sharded

# Names of differing tensors the line lists before it counts the rest.
NAMED = 5


def diagnose(
    engine: Engine, model: nn.Module, resync: Callable[[], None] | None = None, replaying: bool = False
) -> str:
    """One sentence on the cause of an engine/trainer gap: the engine's tensors that a fresh load of the trainer's
    weights gives otherwise, or that there are none.

    Args:
        engine: the run's engine, holding the weights of the rollout that was measured.
        model: the trained model, unwrapped (no DDP / DeepSpeed engine around it); may be a PEFT model.
        resync: writes the trainer's weights into the engine (the trainer's `sync_weights`); needed only where the
            engine released them after the rollout (sleep mode, or a CPU engine's packed weights).
        replaying: the trainer's passes replay the engine's routing (`routing_replay: rollout`), a cause the fresh
            load cannot rule out.

    Returns:
        The sentence, one line; where no comparison could be made, a sentence saying why.
    """
    if is_sharded(model):
        return (
            "The engine was not compared with a fresh load: the model's weights are sharded across ranks (ZeRO-3, "
            "FSDP); run the same model on one process to find which side differs."
        )
    # Asleep, or a CPU engine that dropped its packed weights after the rollout: synced again first, by the same path.
    try:
        weights = saved_weights(model, merge_lora=not engine.serves_adapter)
        differ, compared, unwritten = engine.on_held_weights(fresh.differences_in_engine, weights, resync=resync)
    except Exception as error:  # a diagnosis that fails must not hide the line it adds to
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        return f"The engine was not compared with a fresh load ({reason})."
    architecture = engine.settings["architecture"].get("architectures", ["the model"])[0]
    listed = ", ".join(differ[:NAMED]) + (f" and {len(differ) - NAMED} more" if len(differ) > NAMED else "")
    if differ and set(differ) <= set(unwritten):
        return (
            f"A freshly loaded engine differs only in tensors vLLM's loader never writes ({listed}): given the "
            f"trainer's weights as a checkpoint holds them, vLLM's {architecture} leaves them at their start-up "
            "values, so no sync can deliver them and the engine cannot compute the trainer's model; vLLM's model is "
            "at fault, not colograd's sync: try another vLLM release, or report it to vLLM."
        )
    if differ:
        verb = "is" if len(differ) == 1 else "are"
        # No advice on another sync path: whether one would deliver these tensors is not known without trying it in
        # a new engine, and a hint that changes nothing costs the user a run (it was given for Granite-4.0-H's
        # experts, which neither path prepacked again).
        return (
            f"A freshly loaded engine differs: {len(differ)} of the engine's {compared} tensors and layers {verb} not "
            f"what vLLM's loader makes of the trainer's weights ({listed}): colograd's sync leaves them stale (vLLM's "
            f"{architecture} is not at fault), a bug to report with this line."
        )
    if replaying:
        return (
            f"A freshly loaded engine agrees: all {compared} of the engine's tensors and layers are what vLLM's "
            "loader makes of the trainer's weights, so the sync is complete; the trainer replays the engine's routing "
            "(routing_replay: rollout): run once with routing_replay: off to tell a replay that misroutes tokens from "
            f"vLLM's {architecture} computing another distribution, and report the replay's case with this line."
        )
    return (
        f"A freshly loaded engine agrees: all {compared} of the engine's tensors and layers are what vLLM's loader "
        f"makes of the trainer's weights, so the sync is complete and vLLM's {architecture} and the trainer's "
        "forward compute different distributions from the same weights: one of the two implementations (vLLM's, or "
        "the trainer's model code) departs from the model (docs/real-models.md lists the known cases, on both "
        "sides); train on it with engine_parity: warn and vllm_importance_sampling_correction: true, or report it "
        "with this line."
    )


def saved_weights(model: nn.Module, merge_lora: bool = True) -> list[tuple[str, torch.Tensor]]:
    """The trainer's weights as its checkpoint holds them: every parameter and persistent buffer of the state dict,
    in its checkpoints' layout on disk, as `save_pretrained` writes them: a tied weight once, under the name the model
    loads it by (transformers' `remove_tied_weights_from_state_dict`: no output layer where it is the embeddings, which
    vLLM's Gemma-3n refuses to load), and converted back (`revert_weight_conversion`: Mixtral's experts one by one).
    A PEFT model's weights are those its sync builds: the adapter merged into the weights it adapts (`merge_lora`), or
    the base weights alone for an engine that applies the adapter itself."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    if isinstance(model, PeftModel):
        return [pair for bucket in WeightPlan(model, adapter_only=not merge_lora) for pair in bucket]
    once = remove_tied_weights_from_state_dict(model.state_dict(), model)
    return list(revert_weight_conversion(model, once).items())
