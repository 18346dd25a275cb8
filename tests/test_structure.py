"""The package's import structure: what the trainer is built from never imports the package's root back."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "colograd"
# Names `colograd/__init__.py` exports: importing them from the root runs the root, which imports the trainer.
ROOT_NAMES = {"GRPOConfig", "GRPOTrainer", "ScriptArguments"}


def module_imports(path: Path) -> tuple[set[str], bool]:
    """The colograd modules `path` imports at its top level, and whether it imports the package root itself."""
    modules, root = set(), False
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                root |= alias.name == "colograd"
                if alias.name.startswith("colograd."):
                    modules.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "colograd":
            if node.module == "colograd":
                root |= any(alias.name in ROOT_NAMES for alias in node.names)
                modules |= {f"colograd.{alias.name}" for alias in node.names if alias.name not in ROOT_NAMES}
            else:
                modules.add(node.module)
    return modules, root


def test_the_trainer_and_its_modules_never_import_the_package_root():
    """A module the trainer imports (directly or not) that imports `colograd` at its top makes a cycle
    (colograd → trainer → module → colograd) that only works while the root's names are read late."""
    seen, todo, cycles = set(), ["colograd.trainer"], []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = PACKAGE / (name.removeprefix("colograd.").replace(".", "/") + ".py")
        if not path.exists():  # a package: its __init__
            path = path.with_suffix("") / "__init__.py"
        imported, root = module_imports(path)
        if root:
            cycles.append(name)
        todo += sorted(imported - seen)
    assert len(seen) > 20  # the walk reached the trainer's modules
    assert cycles == []
