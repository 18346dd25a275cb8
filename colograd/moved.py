"""Old module names still import: `colograd.tiny` is `colograd.models.tiny`, with a `FutureWarning` naming the new
path. colograd's modules moved into subpackages (`docs/design.md`); recipes (`reward_funcs: colograd.sums.sum_reward`),
notebooks and subclasses written against the old names keep working, as the same module objects.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

# Old name (under `colograd.`) → new name. Only modules whose names a user could have written: each one moved.
MOVED = {
    "config": "config.core", "config_data": "config.data", "config_engine": "config.engine",
    "config_forward": "config.forward", "config_generation": "config.generation", "config_loading": "config.loading",
    "config_logging": "config.logging", "config_loss": "config.loss", "config_ranges": "config.ranges",
    "config_recipe": "config.recipe", "trl_compat": "config.trl_compat",
    "tiny": "models.tiny", "tiny_vlm": "models.tiny_vlm", "pretrained": "models.pretrained",
    "logit_transform": "models.logit_transform", "model_files": "models.model_files", "precision": "models.precision",
    "checkpoints": "runs.checkpoints", "saving": "runs.saving", "output_dir": "runs.output_dir",
    "preemption": "runs.preemption", "time_limit": "runs.time_limit", "timing": "runs.timing",
    "completions": "runs.completions", "modelcard": "runs.modelcard",
    "data": "data.core", "streaming": "data.streaming", "sums": "data.sums", "code_task": "data.code_task",
    "vision": "vision.core", "preflight_vision": "vision.checks",
    "engine": "engine.core", "engine_cpu": "engine.cpu", "engine_launch": "engine.launch",
    "engine_lifetime": "engine.lifetime", "engine_requests": "engine.requests", "engine_weights": "engine.weights",
    "kv_cache": "engine.kv_cache", "sampler_tap": "engine.sampler_tap", "lora": "engine.lora", "moe": "engine.moe",
    "sync": "engine.sync",
    "rewards": "rewards.core", "early_scoring": "rewards.early", "code_rewards": "rewards.code",
    "code_harness": "rewards.code_harness", "code_tests": "rewards.code_tests", "sandbox": "rewards.sandbox",
    "sandbox_cgroup": "rewards.sandbox_cgroup", "sandbox_launch": "rewards.sandbox_launch",
    "agents": "agents.core", "tools": "agents.tools",
    "loss": "grpo.loss", "logps": "grpo.logps", "packing": "grpo.packing", "attention": "grpo.attention",
    "entropy": "grpo.entropy", "batch": "grpo.batch", "reference": "grpo.reference", "rollouts": "grpo.rollouts",
    "evaluation": "grpo.evaluation", "memory": "grpo.memory",
    "preflight": "preflight.core", "preflight_engine": "preflight.engine", "preflight_env": "preflight.env",
}  # fmt: skip


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; import it from there", FutureWarning, stacklevel=3)


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `colograd.<old>` for each moved module whose old name is not now a subpackage's, and hands back the
    module at its new name."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix("colograd.")
        if fullname.startswith("colograd.") and old in MOVED and old not in _PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        new = "colograd." + MOVED[spec.name.removeprefix("colograd.")]
        _warn(spec.name, new)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # it ran at its new name


_PACKAGES = {new.partition(".")[0] for new in MOVED.values()}


def install() -> None:
    """Adds the finder once (the package's `__init__` calls it)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def forward(package: str):
    """A module `__getattr__` for a subpackage that has an old module's name (`colograd.engine` was
    `engine.py`): a submodule imports as usual; any other name is read from the old module's new home
    (`colograd.engine.core`), so `from colograd.engine import Engine` still works."""

    def __getattr__(name: str):
        if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is not None:
            raise AttributeError(name)  # dunders, and submodules: the import system loads those
        core = importlib.import_module(f"{package}.core")
        value = getattr(core, name)  # AttributeError here is the plain one: no such name, old or new
        _warn(f"{package}.{name}", f"{package}.core.{name}")
        return value

    return __getattr__
