"""The package's import structure: what the trainer is built from never imports the package's root back."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "colograd"
# Names `colograd/__init__.py` exports: importing them from the root runs the root, which imports the trainer.
ROOT_NAMES = {"GRPOConfig", "GRPOTrainer", "ScriptArguments"}


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Every colograd module `path` imports (`from colograd import x` counts as `colograd.x`; a name the root exports
    as `colograd`, the root itself), inside functions too unless `top_level_only`."""
    found = set()
    nodes = ast.parse(path.read_text()).body if top_level_only else ast.walk(ast.parse(path.read_text()))
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "colograd"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "colograd":
            if node.module == "colograd":
                found |= {
                    f"colograd.{alias.name}" if alias.name not in ROOT_NAMES else "colograd" for alias in node.names
                }
            else:
                found.add(node.module)
    return found


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
        imported = imports(path, top_level_only=True)
        if "colograd" in imported:
            cycles.append(name)
        todo += sorted(imported - seen - {"colograd"})
    assert len(seen) > 20  # the walk reached the trainer's modules
    assert cycles == []


# --- the rooms: subpackages by part, imported in one direction ---------------------------------------------------

# Each part imports only the parts before it (and the base modules). Everything under a part counts, imports inside
# functions too: an import deferred to call time is still a dependency.
BASE = ["errors"]  # standard library and torch-free: anything may import them
LAYERS = [
    "config", "models", "runs", "data", "vision", "engine", "rewards", "agents", "grpo", "rollout", "forward",
    "preflight",
]  # fmt: skip
# The faces at the top, which may import any part: the trainer, its command line, the GPU tooling (the check and
# proof), the benchmarks.
FACES = {"__init__", "trainer", "train", "gpu", "bench"}
# Imports that go against the layering on purpose, each with its reason.
ALLOWED = {
    ("colograd.runs.modelcard", "colograd"): "the package's version, read when a card is written",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str | None:
    """The top-level entry a module belongs to: `colograd.engine.sync` → `engine`; the root → `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layering_violations(imports: dict[str, set[str]]) -> list[str]:
    """The imports that go from a part to a later part or to a face, or from a base module to any part."""
    rank = {part: i for i, part in enumerate(LAYERS)}
    wrong = []
    for module, targets in sorted(imports.items()):
        source = part_of(module)
        if source in FACES:
            continue
        for target in sorted(targets):
            if (module, target) in ALLOWED or part_of(target) == source:
                continue
            to = part_of(target)
            if source in BASE:
                ok = to in BASE
            else:
                ok = to in BASE or (to in rank and rank[to] < rank[source])
            if not ok:
                wrong.append(f"{module} imports {target}")
    return wrong


def package_imports() -> dict[str, set[str]]:
    return {module_name(path): imports(path) for path in sorted(PACKAGE.rglob("*.py"))}


def test_the_layering_names_every_top_level_entry():
    """A new module or folder at the top must be placed: a part, a base module or a face."""
    entries = {p.stem if p.suffix == ".py" else p.name for p in PACKAGE.iterdir() if not p.name.startswith((".", "_"))}
    entries |= {"__init__"}
    assert entries == set(LAYERS) | set(BASE) | FACES
    assert len([p for p in PACKAGE.iterdir() if p.suffix == ".py"]) <= 8  # the faces and the base, no more


def test_no_part_imports_a_later_part():
    assert layering_violations(package_imports()) == []


def test_the_layering_check_finds_an_upward_import():
    """The check has power: an import from the engine into the GRPO math, or from a part into the trainer, is
    named, and one that follows the layering is not."""
    imports = package_imports()
    imports["colograd.engine.sync"] = imports["colograd.engine.sync"] | {"colograd.forward.logps"}
    imports["colograd.rewards.core"] = imports["colograd.rewards.core"] | {"colograd.trainer"}
    imports["colograd.grpo.loss"] = imports["colograd.grpo.loss"] | {"colograd.engine.core"}
    assert layering_violations(imports) == [
        "colograd.engine.sync imports colograd.forward.logps",
        "colograd.rewards.core imports colograd.trainer",
    ]


def test_no_import_cycle_between_parts():
    """Parts form a DAG whatever the layering's order says (a check that does not trust `LAYERS`)."""
    edges: dict[str, set[str]] = {}
    for module, targets in package_imports().items():
        source = part_of(module)
        for target in targets:
            if (module, target) not in ALLOWED and part_of(target) != source:
                edges.setdefault(source, set()).add(part_of(target))
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = "done"
        return []

    cycles = [cycle for node in sorted(edges) if node not in state and (cycle := visit(node, []))]
    assert cycles == []


# The engine's own state, which only colograd/engine/ reads or writes: callers use its stated surface
# (`Engine.requests`, `sync`, `in_workers`, `on_held_weights`, `serves_adapter`, `dtype`, ...).
ENGINE_INTERNALS = {"llm", "stale", "weights_resident", "packed_released", "_awake", "lora_request", "_synced_version"}


def engine_internal_reads(source: str) -> list[str]:
    """`<...engine>.<internal>` in `source`: an attribute of ENGINE_INTERNALS read off a name or attribute whose
    name is `engine` or ends in `_engine` / `.engine` (`trainer.engine.llm`, `engine.stale`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS:
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name == "engine" or name.endswith("_engine"):
                found.append((node.lineno, f"line {node.lineno}: {ast.unparse(node)}"))
    return [text for _, text in sorted(found)]


def test_no_module_outside_the_engine_reads_its_state():
    """Outside colograd/engine/, nothing touches `engine.llm` or the engine's state flags (issue: the engine has one
    surface). The last change that added a flag had to patch every caller that read them."""
    reads = {
        module_name(path): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if "engine" not in path.relative_to(PACKAGE).parts[:1] and (found := engine_internal_reads(path.read_text()))
    }
    assert not reads, reads


def test_the_engine_state_check_finds_a_read():
    assert engine_internal_reads("x = trainer.engine.llm.generate(p)\nif self.engine.stale: pass\n") == [
        "line 1: trainer.engine.llm",
        "line 2: self.engine.stale",
    ]
    assert engine_internal_reads("requests = engine.requests()\nrequests.llm.generate(p)\n") == []


def test_no_two_test_files_share_a_name():
    """pytest imports test files by their basename (no packages under tests/): a second file of the same name in
    another folder fails to collect ("import file mismatch"), and with it the whole tier."""
    names = {}
    tests = PACKAGE.parent / "tests"
    for path in sorted(tests.rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(tests)))
    shared = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not shared, shared
