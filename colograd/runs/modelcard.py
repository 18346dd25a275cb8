"""The model card written next to every saved model: Hub metadata, the recipe it was trained with, final metrics.

Recipe paths are a public API: a card names the recipe's path in the colograd repository (for example
`recipes/grpo_tiny.yaml`) and embeds the file as it was, with the command-line flags that overrode it, so the
run can be repeated from the card alone.
"""

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

REPO_ROOT = Path(__file__).resolve().parents[2]
TAGS = ["colograd", "grpo"]
# The metrics a card reports, in this order, when the run logged them; rewards/<func>/mean are added after.
_REPORTED = ["reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "loss"]


@dataclass
class Recipe:
    """What a command-line run was launched from, which the trainer itself does not know.

    path: the recipe's path, relative to the colograd repository when it lies inside it.
    text: the recipe file as it was at launch.
    overrides: the command-line flags given after the recipe; they take precedence over its keys.
    model_name_or_path: the model the run started from.
    dataset_name: the dataset it trained on.
    launcher: the command that started the processes (`launcher_of`): "python", "accelerate launch", "torchrun ...".
    in_repository: whether `path` lies in the colograd repository (else it is the path the run was given).
    """

    path: str
    text: str
    overrides: list[str] = field(default_factory=list)
    model_name_or_path: str | None = None
    dataset_name: str | None = None
    launcher: str = "accelerate launch"
    in_repository: bool = True

    @classmethod
    def from_argv(cls, argv: list[str], model_name_or_path: str | None, dataset_name: str | None) -> "Recipe | None":
        """The recipe named by `--config PATH` (or `--config=PATH`) in `argv`; None when there is none."""
        for i, arg in enumerate(argv):
            if arg == "--config" and i + 1 < len(argv):
                config, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
            elif arg.startswith("--config="):
                config, rest = arg.split("=", 1)[1], argv[:i] + argv[i + 1 :]
            else:
                continue
            resolved = Path(config).resolve()
            inside = resolved.is_relative_to(REPO_ROOT)
            path = resolved.relative_to(REPO_ROOT) if inside else Path(config)
            text = resolved.read_text()
            return cls(path.as_posix(), text, rest, model_name_or_path, dataset_name, launcher_of(os.environ), inside)
        return None


def launcher_of(env: "os._Environ[str] | dict[str, str]") -> str:
    """The command that started this process, from the variables launchers set: accelerate's (`ACCELERATE_*`),
    torchrun's (`TORCHELASTIC_RUN_ID`, with its processes per node), or none: a plain `python`."""
    if any(name.startswith("ACCELERATE_") for name in env) and "LOCAL_RANK" in env:
        return "accelerate launch"
    if "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun --nproc_per_node {env.get('LOCAL_WORLD_SIZE', '1')}"
    return "python"


def model_card(
    model_name: str,
    base_model: str | None,
    recipe: Recipe | None,
    log_history: list[dict[str, float]],
    world_size: int,
    tags: list[str] | None = None,
) -> ModelCard:
    """Build the card of a GRPO-trained model.

    Args:
        model_name: the name the card is titled with (the output folder's or the Hub repository's).
        base_model: the model training started from, as a Hub id or a description.
        recipe: the recipe of a command-line run; None for a run started from Python.
        log_history: the trainer's `state.log_history`; the last logged step gives the final metrics.
        world_size: the number of training processes (each with its own engine).
        tags: extra Hub tags, added to `colograd` and `grpo`.
    """
    dataset = recipe.dataset_name if recipe else None
    data = ModelCardData(
        model_name=model_name,
        base_model=_hub_id(base_model),
        datasets=[dataset] if _hub_id(dataset) else None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=TAGS + [t for t in tags or [] if t not in TAGS],
    )
    if _hub_id(base_model):
        origin = f"[{base_model}](https://huggingface.co/{base_model})"
    else:
        origin = f"`{base_model}`" if base_model else "a model built in memory"
    processes = "process" if world_size == 1 else "processes"
    sections = [
        f"# {model_name}",
        f"Trained from {origin} with GRPO by colograd on {world_size} {processes}; each process generated its "
        "rollouts with a vLLM engine of its own, inside it.",
        _recipe_section(recipe),
        _metrics_section(log_history),
        _framework_versions(),
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n")


def write_model_card(card: ModelCard, output_dir: str) -> str:
    """Save `card` as `<output_dir>/README.md` and return that path."""
    path = os.path.join(output_dir, "README.md")
    os.makedirs(output_dir, exist_ok=True)
    card.save(path)
    return path


def _recipe_section(recipe: Recipe | None) -> str:
    if recipe is None:
        return "## Recipe\n\nTrained from Python with `colograd.GRPOTrainer`, not from a recipe file."
    command = shlex.join(["colograd/train.py", "--config", recipe.path, *recipe.overrides])
    where = "of the colograd repository" if recipe.in_repository else "(a file of the run's own, embedded below)"
    return (
        f"## Recipe\n\nTrained with the recipe `{recipe.path}` {where}, run as\n\n"
        f"```bash\n{recipe.launcher} {command}\n```\n\n"
        "(flags after the recipe override its keys). The recipe as it was at launch:\n\n"
        f"```yaml\n{recipe.text.rstrip()}\n```"
    )


def _metrics_section(log_history: list[dict[str, float]]) -> str:
    steps = [entry for entry in log_history if "loss" in entry]
    if not steps:
        return "## Final metrics\n\nNo training step was logged."
    last = steps[-1]
    names = [k for k in _REPORTED if k in last] + sorted(k for k in last if k.startswith("rewards/"))
    rows = "\n".join(f"| `{name}` | {last[name]:.4g} |" for name in names)
    return f"## Final metrics\n\nLogged at step {last['step']}:\n\n| metric | value |\n|---|---|\n{rows}"


def _hub_id(name: str | None) -> str | None:
    """`name` when it can be a Hub repository id (`org/name` or `name`), None for built-ins and local paths."""
    if not name or name.startswith("colograd:") or os.path.exists(name) or name.count("/") > 1:
        return None
    return name


def _framework_versions() -> str:
    import accelerate
    import torch
    import transformers
    import trl
    import vllm

    import colograd  # here, not at the top: the package imports the trainer, which imports this module

    modules = [colograd, vllm, transformers, trl, torch, accelerate]
    return "## Framework versions\n\n" + "\n".join(f"- {m.__name__}: {m.__version__}" for m in modules)
