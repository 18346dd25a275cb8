"""What a PEFT LoRA adapter needs from the engine, checked before the engine starts.

vLLM's LoRA support (adapter-only sync) refuses some PEFT options only when it first loads the adapter, at
the first generation, after minutes of start-up; and it takes `max_lora_rank` only from a fixed set of sizes.
A merged sync (base + B·A) serves any plain LoRA, but not options whose merged weight is more than that sum.
vLLM is imported inside the functions: `colograd.engine.core` sets the environment vLLM reads at import.
Where an adapter-only sync writes the adapter's files for the engine is here too (`adapter_parent`).
"""

import os
import shutil
import typing

from peft import LoraConfig

from colograd.config.core import ConfigError

# PEFT options an adapter-only engine does not apply on every vLLM release colograd runs on, whatever that
# release's own check says: 0.26's loader fails on a LoRA bias at the first generation, and serves aLoRA,
# replicated layers and QA-LoRA as a plain LoRA (sampling from another model than the one trained).
UNSERVED = {
    "lora_bias": "lora_bias",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "layer_replication": "layer_replication",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "BD-LoRA (use_bdlora)",
}


def adapter_rank(config: LoraConfig) -> int:
    """The largest rank among the adapter's layers (`r`, or a larger one from `rank_pattern`)."""
    return max([config.r, *(config.rank_pattern or {}).values()])


def engine_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of `rank`.

    Raises:
        ConfigError: the rank is above the largest size vLLM serves.
    """
    from vllm.config.lora import MaxLoRARanks

    accepted = sorted(typing.get_args(MaxLoRARanks))
    fitting = [size for size in accepted if size >= rank]
    if not fitting:
        raise ConfigError(
            f"LoRA rank {rank} is above the largest rank vLLM serves ({accepted[-1]}); lower lora_r (or "
            "rank_pattern), or set lora_sync: merged."
        )
    return fitting[0]


def check_lora(config: LoraConfig, lora_sync: str) -> int | None:
    """Refuse an adapter the chosen sync cannot serve, in one line naming the option and the fix.

    Args:
        config: the active adapter's PEFT config.
        lora_sync: 'adapter' (vLLM applies the adapter) or 'merged' (base + B·A written into the weights).

    Returns:
        The adapter's rank for an adapter-only sync (the engine's LoRA must hold it), None for a merged one.
    """
    if lora_sync == "merged":
        # Their merged weight is not base + B·A (DoRA rescales it; a LoRA bias adds a bias term): a merged sync
        # would serve a different model than the one trained.
        options = ((config.use_dora, "DoRA (use_dora)"), (config.lora_bias, "lora_bias"))
        refused = [label for on, label in options if on]
        if refused:
            raise ConfigError(
                f"lora_sync=merged cannot serve {' or '.join(refused)}: the merged weight is not base + B·A; "
                "use a plain LoRA adapter."
            )
        return None
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    rank = adapter_rank(config)
    engine_config = LoRAConfig(max_lora_rank=engine_max_lora_rank(rank))
    unserved = [label for option, label in UNSERVED.items() if getattr(config, option, None)]
    if (config.rank_pattern or config.alpha_pattern) and not hasattr(PEFTHelper, "get_rank_and_scaling"):
        unserved.append("a per-layer rank or alpha (rank_pattern, alpha_pattern), which this vLLM scales as r's")
    if unserved:
        raise ConfigError(
            f"lora_sync=adapter: vLLM cannot serve this adapter's {' or '.join(unserved)}; set lora_sync: merged, "
            "or drop the option."
        )
    # vLLM's own check, the one its loader runs at the first generation (DoRA, modules_to_save, LoRA bias,
    # PiSSA-style inits, aLoRA, ...), run on the config alone.
    try:
        PEFTHelper.from_dict(config.to_dict()).validate_legal(engine_config)
    except ValueError as err:
        raise ConfigError(
            f"lora_sync=adapter: vLLM cannot serve this adapter: {err} Set lora_sync: merged, or drop the option."
        ) from err
    return rank


def adapter_parent(nbytes: int) -> str | None:
    """Where to write an adapter of `nbytes`: RAM-backed /dev/shm where it has room for two copies (a rewrite
    may keep the old file's pages until it is replaced), else the default temporary folder (disk).

    Containers often mount /dev/shm at 64 MiB, less than an fp32 adapter of a 1.5B model.
    """
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free >= 2 * nbytes:
        return "/dev/shm"
    return None


def serve_adapter_in_worker(worker: typing.Any, tensors: dict, request: typing.Any) -> None:
    """Runs in the engine's worker: serve `tensors` (PEFT names, on the trainer's device; they become the
    engine's: vLLM packs and scales them in place) as the adapter of `request`, replacing the version it serves.

    vLLM's own `load_inplace` reads the adapter back from its folder to the host and copies it into the device's
    LoRA slot at every sync. Here the same steps run on the tensors as they are, with vLLM's own functions:
    `LoRAModel.from_lora_tensors` (names mapped as for the checkpoint, rank and scaling from the folder's config),
    the same checks, then remove, add and activate, which packs q/k/v and gate/up, scales B and writes the slot.
    The adapter's first version was read from the folder by vLLM's loader (which also checks its names against the
    model's modules); later versions have the same names and shapes.
    """
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed

    manager = worker.model_runner.lora_manager
    adapters = manager._adapter_manager
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=request.lora_int_id,
        tensors=tensors,
        peft_helper=PEFTHelper.from_local_dir(request.lora_path, manager.max_position_embeddings),
        device=str(next(iter(tensors.values())).device),
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=_lora_names(mapper),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    lora.is_3d_lora_weight = request.is_3d_lora_weight
    for name in ("_validate_moe_lora_format", "_validate_modules_to_save", "_validate_token_classification_lora"):
        validate = getattr(adapters, name, None)  # vLLM 0.32 on; 0.26's loader checks within, as it read version 1
        if validate is not None:
            validate(lora)
    with gpu_sync_allowed():
        adapters.remove_adapter(lora.id)
        adapters.add_adapter(lora)
        adapters.activate_adapter(lora.id)


def _lora_names(mapper: typing.Any) -> typing.Any:
    """The model's checkpoint-name mapper as vLLM's own LoRA loader applies it to adapter names: renames only
    (`get_rename_mapper`, vLLM 0.32 on), or all but the stacking (`get_unstacked_mapper`, vLLM 0.26)."""
    if mapper is None:
        return None
    rename = getattr(mapper, "get_rename_mapper", None) or mapper.get_unstacked_mapper
    return rename()
