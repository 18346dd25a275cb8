"""Preflight's environment stage: the variables a run inherits, checked before anything slow starts.

A shell, a job script or a container sets variables that no recipe shows, and a wrong one fails a run minutes in,
inside a library: a cache folder that cannot be written fails the first download or the first compile, a tracker
with no login prompts or stops at the first log, a rank or port that is not a number stops the engine's start. Three
declared tables cover the kind, each walked whole:

    CACHES    every cache folder a run may write, with the variables that choose it in the order its library reads
              them, and when this run writes it; the chosen folder must be one that can be written (created)
    HARDWARE  the device, thread and launch variables, each with a check of its value: what it must parse as, and
              that what it names exists on this machine (GPUs, cores); then the launch variables against each other
    TRACKERS  every `report_to` value: its package installed, and for wandb a login (or an offline mode)

A problem that certainly stops the run is a `ConfigError` naming the variable, the problem and the fix. One that
only risks it (a variable this run does not read, an oversubscribed CPU, a GPU machine asked to run on its CPU) is
one warning line on stderr, and the run goes on. An unset variable is never a problem, nor a cache folder that does
not exist yet where it can be created.

`colograd/train.py` runs `check_variables` before it parses (the parser reads the launch variables) and
`check_environment` before it loads anything; `GRPOTrainer` runs `check_environment` first.
"""

import configparser
import netrc
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import torch

from colograd.errors import ConfigError
from colograd.models.pretrained import MODELS

_TRUE = ("1", "true", "yes", "on")
_BUILT_IN = "colograd:"  # colograd's built-in models and datasets (colograd.models.tiny, colograd.models.pretrained)


class Issue(NamedTuple):
    """What is wrong with a variable: one line, and whether it stops the run (else it is a warning)."""

    text: str
    fatal: bool


@dataclass(frozen=True)
class Run:
    """What a run will do that decides which caches it writes.

    Args:
        hub_names: names of models and datasets read from the Hugging Face hub.
        loads_dataset: the dataset is read by `datasets.load_dataset` (a file or a hub id), which writes its cache.
        pretrained: the model is one of colograd's built-in pretrained models, converted once into its cache.
        compiles: the engine or the policy compiles (`vllm_enforce_eager` false, or `torch_compile`).
        gpu: the run has a GPU (Triton compiles kernels for it).
        remote_code: `trust_remote_code`: transformers copies the model's code into its modules cache.
        offline: HF_HUB_OFFLINE: the hub cache is only read.
    """

    hub_names: tuple[str, ...] = ()
    loads_dataset: bool = False
    pretrained: bool = False
    compiles: bool = False
    gpu: bool = False
    remote_code: bool = False
    offline: bool = False


# --- caches --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cache:
    """A cache folder a run may write.

    Args:
        what: what it holds, as a message names it.
        chain: (variable, folder under it) in the order the library reads them: the first one set decides; HOME
            last stands for the default under the home folder.
        written: whether a run writes it.
    """

    what: str
    chain: tuple[tuple[str, str], ...]
    written: Callable[[Run], bool]


def _hf(sub: str) -> tuple[tuple[str, str], ...]:
    """The chain of a folder under HF_HOME (huggingface_hub's and datasets' defaults)."""
    return (
        ("HF_HOME", sub),
        ("XDG_CACHE_HOME", os.path.join("huggingface", sub)),
        ("HOME", os.path.join(".cache", "huggingface", sub)),
    )


def _downloads(run: Run) -> bool:
    return bool(run.hub_names) and not run.offline


CACHES = (
    Cache(
        "the Hugging Face hub cache", (("HF_HUB_CACHE", ""), ("HUGGINGFACE_HUB_CACHE", ""), *_hf("hub")), _downloads
    ),
    Cache("the Hugging Face Xet cache", (("HF_XET_CACHE", ""), *_hf("xet")), _downloads),
    Cache("the datasets cache", (("HF_DATASETS_CACHE", ""), *_hf("datasets")), lambda run: run.loads_dataset),
    Cache(
        "transformers' remote-code modules", (("HF_MODULES_CACHE", ""), *_hf("modules")), lambda run: run.remote_code
    ),
    Cache(
        "colograd's converted models",
        (("COLOGRAD_CACHE", ""), ("HOME", os.path.join(".cache", "colograd"))),
        lambda run: run.pretrained,
    ),
    Cache(
        "vLLM's compile cache",
        (("VLLM_CACHE_ROOT", ""), ("XDG_CACHE_HOME", "vllm"), ("HOME", os.path.join(".cache", "vllm"))),
        lambda run: run.compiles,
    ),
    # Its default is under the temporary folder, which Python and compilers replace by /tmp when it is unusable.
    Cache("TorchInductor's cache", (("TORCHINDUCTOR_CACHE_DIR", ""),), lambda run: run.compiles),
    Cache(
        "Triton's kernel cache",
        (("TRITON_CACHE_DIR", ""), ("TRITON_HOME", os.path.join(".triton", "cache")), ("HOME", ".triton/cache")),
        lambda run: run.gpu,
    ),
)


def cache_folder(cache: Cache, env: Mapping[str, str]) -> tuple[str, str] | None:
    """The variable that decides where `cache` is, and the folder; None where no variable of its chain is set
    (a default under the temporary folder)."""
    for variable, sub in cache.chain:
        value = os.path.expanduser("~") if variable == "HOME" else env.get(variable)
        if value:
            return variable, os.path.normpath(os.path.join(os.path.expandvars(os.path.expanduser(value)), sub))
    return None


def folder_problem(path: str) -> str | None:
    """Why `path` cannot serve as a folder to write in, or None: it is a file, lies under a file, cannot be written,
    or cannot be created (a missing folder is made by the library, parents and all, where its nearest existing
    parent can be written). Tried by writing a file, as the library will (permissions alone do not say: a root
    process may write in a folder without write permission, and none may in a read-only file system)."""
    target = os.path.abspath(path)
    existing = target
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return "is a file, not a folder" if existing == target else f"lies under {existing}, which is a file"
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".colograd-write-test-"):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        return f"cannot be written ({reason})" if existing == target else f"cannot be created in {existing} ({reason})"
    return None


def cache_issues(run: Run, env: Mapping[str, str]) -> list[Issue]:
    """The caches this run writes whose folder cannot be written (see `CACHES`), and the variables that point
    somewhere unusable without stopping it (TMPDIR, TRANSFORMERS_CACHE)."""
    issues = []
    for cache in CACHES:
        found = cache_folder(cache, env)
        if not cache.written(run) or found is None:
            continue
        variable, folder = found
        problem = folder_problem(folder)
        if problem is None:
            continue
        named = f"{variable}={env[variable]!r}" if variable != "HOME" else f"HOME={os.path.expanduser('~')!r}"
        fix = f"set {cache.chain[0][0]} to" if variable == "HOME" else f"point {variable} at"
        offline = "; or set HF_HUB_OFFLINE=1 to only read a filled cache" if cache.written is _downloads else ""
        issues.append(
            Issue(f"{named}: {folder}, {cache.what}, {problem}; {fix} a folder you can write to{offline}.", True)
        )
    tmp = env.get("TMPDIR")
    if tmp and (problem := folder_problem(tmp)) is not None:
        issues.append(
            Issue(f"TMPDIR={tmp!r} {problem}; temporary files go to /tmp instead. Unset it or fix it.", False)
        )
    old = env.get("TRANSFORMERS_CACHE")
    hub = cache_folder(CACHES[0], env)
    if old and hub is not None and os.path.abspath(old) != os.path.abspath(hub[1]):
        issues.append(
            Issue(
                f"TRANSFORMERS_CACHE={old!r} is not read by transformers 5: models are cached in {hub[1]}; set "
                "HF_HUB_CACHE instead.",
                False,
            )
        )
    return issues


# --- hardware and launch variables ---------------------------------------------------------------------------


def machine_gpus() -> int:
    """The NVIDIA GPUs this machine has, whatever CUDA_VISIBLE_DEVICES shows (the driver lists one folder each)."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def usable_cores() -> set[int]:
    """The CPU cores this process may run on (its affinity: a container's or a `taskset`'s share)."""
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _integer(value: str, least: int) -> int | None:
    try:
        number = int(value.strip())
    except ValueError:
        return None
    return number if number >= least else None


def _visible_devices(value: str) -> Issue | None:
    """CUDA numbers the GPUs it shows from this list; an entry it cannot read ends the list, an index past the last
    GPU shows none, so a typo leaves a GPU machine training on its CPU or failing at the first CUDA call."""
    gpus = machine_gpus()
    if gpus == 0:  # a CPU machine: the variable points at nothing and is read by nothing
        return None
    entries = [e.strip() for e in value.split(",")]
    if value.strip() in ("", "-1"):
        return Issue(
            f"CUDA_VISIBLE_DEVICES={value!r} hides all {gpus} GPUs of this machine: the run will use its CPU; "
            "unset it or name the GPUs (e.g. 0,1).",
            False,
        )
    for entry in entries:
        if entry.startswith(("GPU-", "MIG-")):  # UUIDs, which CUDA resolves itself
            continue
        index = _integer(entry, 0)
        if index is None:
            return Issue(
                f"CUDA_VISIBLE_DEVICES={value!r}: {entry!r} is not a GPU index or UUID; give indices 0-{gpus - 1} "
                "separated by commas.",
                True,
            )
        if index >= gpus:
            return Issue(
                f"CUDA_VISIBLE_DEVICES={value!r} names GPU {index}, but this machine has {gpus} (0-{gpus - 1}); "
                "name GPUs that exist.",
                True,
            )
    if len(set(entries)) < len(entries):
        # CUDA then shows no GPU at all (torch.cuda._parse_visible_devices mirrors it).
        return Issue(f"CUDA_VISIBLE_DEVICES={value!r} names a GPU twice, which hides them all; name each once.", True)
    return None


def _thread_count(name: str) -> Callable[[str], Issue | None]:
    """A thread count (OpenMP's form: a count per nesting level, comma-separated). Neither a malformed one (OpenMP
    ignores it, with a note of its own, and takes every core) nor more threads than cores (each step slows) stops
    a run: both are warnings."""

    def check(value: str) -> Issue | None:
        counts = [_integer(part, 1) for part in value.split(",")]
        if None in counts:
            return Issue(
                f"{name}={value!r} is not a positive whole number of threads, so it is ignored; set e.g. {name}=4.",
                False,
            )
        cores = len(usable_cores())
        if counts[0] > cores:
            return Issue(
                f"{name}={value!r} is more threads than the {cores} cores this process may use, which slows "
                f"every step; set {name}={cores} or fewer.",
                False,
            )
        return None

    return check


def _whole(name: str, least: int, fix: str) -> Callable[[str], Issue | None]:
    """A variable that must be a whole number of at least `least`."""

    def check(value: str) -> Issue | None:
        if _integer(value, least) is None:
            return Issue(f"{name}={value!r} is not a whole number of at least {least}; {fix}.", True)
        return None

    return check


def _port(value: str) -> Issue | None:
    if _integer(value, 1) is None or int(value) > 65535:
        return Issue(f"MASTER_PORT={value!r} is not a TCP port; set a number from 1024 to 65535, or unset it.", True)
    return None


def _omp_bind(value: str) -> Issue | None:
    """vLLM's CPU thread binding, which only its multi-process executor reads: colograd's engine runs inside the
    training process on that process's threads."""
    if value.strip() == "auto":
        return None
    return Issue(
        f"VLLM_CPU_OMP_THREADS_BIND={value!r} has no effect here: colograd's engine runs in the training process; "
        "bind that process (taskset, numactl) and size its threads with OMP_NUM_THREADS.",
        False,
    )


_LAUNCH = "unset it (a launcher such as accelerate or torchrun sets it)"

# The variables a run reads from the machine it is on, with a check of a value. Launch variables are set by a
# launcher; one left over in a shell (`export LOCAL_RANK=0`) is the usual source of a bad one.
HARDWARE: dict[str, Callable[[str], Issue | None]] = {
    "CUDA_VISIBLE_DEVICES": _visible_devices,
    "OMP_NUM_THREADS": _thread_count("OMP_NUM_THREADS"),
    "MKL_NUM_THREADS": _thread_count("MKL_NUM_THREADS"),
    "VLLM_CPU_KVCACHE_SPACE": _whole("VLLM_CPU_KVCACHE_SPACE", 0, "give GiB as a whole number, or unset it"),
    "VLLM_CPU_OMP_THREADS_BIND": _omp_bind,
    "RANK": _whole("RANK", 0, _LAUNCH),
    "LOCAL_RANK": _whole("LOCAL_RANK", -1, _LAUNCH),  # -1: transformers' "no launcher"
    "WORLD_SIZE": _whole("WORLD_SIZE", 1, _LAUNCH),
    "LOCAL_WORLD_SIZE": _whole("LOCAL_WORLD_SIZE", 1, _LAUNCH),
    "MASTER_PORT": _port,
}


def launch_issue(env: Mapping[str, str]) -> Issue | None:
    """The launch variables against each other (each one already parses): a rank below its world size."""
    pairs = (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE"), ("LOCAL_WORLD_SIZE", "WORLD_SIZE"))
    for low, high in pairs:
        if low in env and high in env:
            limit = int(env[high]) - (1 if low != "LOCAL_WORLD_SIZE" else 0)
            if int(env[low]) > limit:
                return Issue(
                    f"{low}={env[low]} does not fit {high}={env[high]}; unset both (a launcher sets them) or set "
                    f"{low} at most {limit}.",
                    True,
                )
    if int(env.get("WORLD_SIZE", "1")) > 1 and "RANK" not in env:
        return Issue(f"WORLD_SIZE={env['WORLD_SIZE']} is set, but RANK is not: {_LAUNCH}.", True)
    # A LOCAL_RANK makes transformers join a process group, which needs the rest of a launch's variables.
    if int(env.get("LOCAL_RANK", "-1")) >= 0:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if not env.get(name)]
        if missing:
            return Issue(
                f"LOCAL_RANK={env['LOCAL_RANK']} is set, but {missing[0]} is not: a launcher sets them together; "
                "unset LOCAL_RANK (left from another launch?) or start with accelerate launch or torchrun.",
                True,
            )
    return None


def hardware_issues(env: Mapping[str, str]) -> list[Issue]:
    """Every set variable of `HARDWARE` checked, then the launch variables together, unless the launch already
    formed its process group: then they evidently worked, and since the first engine vLLM's CPU platform sets
    LOCAL_WORLD_SIZE to the engine's tensor-parallel size (a second trainer on rank 1 would be refused)."""
    issues = [issue for name, check in HARDWARE.items() if name in env and (issue := check(env[name])) is not None]
    formed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not formed and not any(issue.fatal for issue in issues) and (issue := launch_issue(env)) is not None:
        issues.append(issue)
    return issues


# --- trackers ------------------------------------------------------------------------------------------------

# `report_to` values → transformers' own test that the tracker's package is installed, and what to install.
TRACKERS = {
    "wandb": ("is_wandb_available", "wandb"),
    "trackio": ("is_trackio_available", "trackio"),
    "tensorboard": ("is_tensorboard_available", "tensorboard"),
    "mlflow": ("is_mlflow_available", "mlflow"),
    "comet_ml": ("is_comet_available", "comet_ml"),
    "clearml": ("is_clearml_available", "clearml"),
    "neptune": ("is_neptune_available", "neptune"),
    "dagshub": ("is_dagshub_available", "dagshub mlflow"),
    "codecarbon": ("is_codecarbon_available", "codecarbon"),
    "azure_ml": ("is_azureml_available", "azureml-core"),
    "flyte": ("is_flytekit_available", "flytekit"),
    "dvclive": ("is_dvclive_available", "dvclive"),
    "swanlab": ("is_swanlab_available", "swanlab"),
}


def tracker_issues(report_to: list[str], env: Mapping[str, str]) -> list[Issue]:
    """Every tracker of `report_to` installed; wandb logged in, or told not to need it."""
    from transformers.integrations import integration_utils

    issues = []
    for tracker in report_to:
        if tracker not in TRACKERS:
            continue  # transformers names the trackers it knows when it meets another
        available, package = TRACKERS[tracker]
        if not getattr(integration_utils, available)():
            issues.append(
                Issue(
                    f"report_to: {tracker} is not installed; pip install {package}, or remove it from report_to.", True
                )
            )
        elif tracker == "wandb" and not wandb_logged_in(env):
            issues.append(
                Issue(
                    "report_to: wandb has no login (no WANDB_API_KEY, no netrc entry) and would stop at its first "
                    "log; run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline.",
                    True,
                )
            )
    return issues


def wandb_logged_in(env: Mapping[str, str]) -> bool:
    """Whether wandb will start without asking for a key: an offline or disabled mode, a key or identity token in
    the environment, a netrc entry for its host, or a key in its settings file (wandb's own order)."""
    if (
        env.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled")
        or env.get("WANDB_DISABLED", "") in _TRUE
    ):
        return True
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    home = os.path.expanduser("~")
    paths = [env["NETRC"]] if env.get("NETRC") else [os.path.join(home, ".netrc"), os.path.join(home, "_netrc")]
    for path in paths:
        try:
            if netrc.netrc(os.path.expanduser(path)).authenticators(host):
                return True
        except (OSError, netrc.NetrcParseError):
            continue
    settings = configparser.ConfigParser()
    config_dir = env.get("WANDB_CONFIG_DIR") or os.path.join(home, ".config", "wandb")
    try:
        settings.read(os.path.join(config_dir, "settings"))
    except configparser.Error:
        return False
    return bool(settings.get("default", "api_key", fallback=""))


# --- hub offline ---------------------------------------------------------------------------------------------


def offline_issue(model: str | None, revision: str | None, env: Mapping[str, str]) -> Issue | None:
    """HF_HUB_OFFLINE with a hub model that is not in the cache: transformers would fail to find it after the
    imports, naming a connection error."""
    if not model or not _offline(env) or not is_hub_name(model):
        return None
    from huggingface_hub import try_to_load_from_cache

    cache = cache_folder(CACHES[0], env)[1]
    if isinstance(try_to_load_from_cache(model, "config.json", cache_dir=cache, revision=revision), str):
        return None
    return Issue(
        f"HF_HUB_OFFLINE is set, but model {model!r} is not in the hub cache ({cache}); download "
        f"it once with the network (`hf download {model}`), or unset HF_HUB_OFFLINE.",
        True,
    )


def _offline(env: Mapping[str, str]) -> bool:
    return (env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or "").lower() in _TRUE


def is_hub_name(name: str) -> bool:
    """A name read from the hub: not a built-in, not a local file or folder."""
    return not name.startswith(_BUILT_IN) and not os.path.exists(name) and not name.startswith((".", "/", "~"))


# --- the stage -----------------------------------------------------------------------------------------------


def check_variables(env: Mapping[str, str] | None = None) -> None:
    """The problems of `HARDWARE` that stop a run, before parsing (which reads the launch variables); their warnings
    are left to `check_environment`, which checks them again."""
    _report([issue for issue in hardware_issues(os.environ if env is None else env) if issue.fatal])


def check_environment(
    args: Any,
    model: str | None = None,
    dataset: str | None = None,
    revision: str | None = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """The environment against the run: caches it writes, hardware and launch variables, trackers, offline hub.

    Args:
        args: the run's `GRPOConfig`.
        model: the model's name when it is loaded by name (a hub id, a folder, a built-in), else None.
        dataset: the dataset's name when it is loaded by name (the command line), else None.
        revision: the model's revision.
        env: the variables (default `os.environ`).

    Raises:
        ConfigError: the first problem that stops the run; the others are printed as warnings.
    """
    env = os.environ if env is None else env
    names = tuple(n for n in (model, dataset) if n and is_hub_name(n))
    run = Run(
        hub_names=names,
        loads_dataset=bool(dataset) and not dataset.startswith(_BUILT_IN),
        pretrained=model in MODELS,
        compiles=not args.vllm_enforce_eager or bool(getattr(args, "torch_compile", False)),
        gpu=machine_gpus() > 0 and env.get("CUDA_VISIBLE_DEVICES", "0").strip() not in ("", "-1"),
        remote_code=bool(getattr(args, "trust_remote_code", False)) and bool(model),
        offline=_offline(env),
    )
    issues = hardware_issues(env) + cache_issues(run, env) + tracker_issues(list(args.report_to or []), env)
    issues.append(offline_issue(model, revision, env))
    _report([issue for issue in issues if issue is not None])


_warned: set[str] = set()  # the command line checks before the trainer does: each warning is printed once


def _report(issues: list[Issue]) -> None:
    """Raise the first fatal issue; print the warnings once per run (rank 0) before it."""
    if _integer(os.environ.get("RANK", "0"), 0) in (0, None):
        for issue in issues:
            if not issue.fatal and issue.text not in _warned:
                _warned.add(issue.text)
                print(f"colograd: warning: {issue.text}", file=sys.stderr, flush=True)
    fatal = [issue for issue in issues if issue.fatal]
    if fatal:
        raise ConfigError(fatal[0].text)
