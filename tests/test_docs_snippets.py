"""The code blocks of README.md and docs/ are true as a newcomer pastes them: every Python block parses and its
imports resolve, every `GRPOConfig(...)` keyword is a field; every recipe key in a YAML block and every flag of a
`colograd/train.py` command is a field the parser knows, every file it names exists; every `python -m colograd.bench`
subcommand and every `make` target exists. The quickstart's Python block runs as written (slow tier).

A block a reader cannot paste alone (it continues an earlier one, or sketches a method) is still held to all of the
above that applies: its imports, its names of fields and files."""

import ast
import dataclasses
import importlib
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT
from trl import ModelConfig

from colograd import GRPOConfig, ScriptArguments
from colograd.bench.__main__ import BENCHMARKS
from colograd.config.trl_compat import DROPPED_KEYS, RENAMED_KEYS

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
FIELDS = {f.name for cls in (GRPOConfig, ScriptArguments, ModelConfig) for f in dataclasses.fields(cls)}
KNOWN_KEYS = FIELDS | set(RENAMED_KEYS) | set(DROPPED_KEYS) | {"env"}


def blocks(language: str) -> list[tuple[str, str]]:
    """(page:line, code) of every block of `language` on the pages."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            if match.group(1) == language:
                line = text.count("\n", 0, match.start()) + 1
                found.append((f"{page.relative_to(ROOT)}:{line}", match.group(2)))
    return found


PYTHON, BASH, YAML = blocks("python"), blocks("bash"), blocks("yaml")


@pytest.mark.parametrize("where, code", PYTHON, ids=[w for w, _ in PYTHON])
def test_a_python_block_parses_and_its_colograd_imports_resolve(where, code):
    tree = ast.parse(code, filename=where)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "colograd":
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):  # a submodule not imported by its package yet
                    importlib.import_module(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "colograd":
                    importlib.import_module(alias.name)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "GRPOConfig":
            unknown = {k.arg for k in node.keywords if k.arg} - FIELDS
            assert not unknown, f"{where}: GRPOConfig has no {sorted(unknown)}"


def test_the_import_check_catches_a_moved_module():
    with pytest.raises(ImportError):
        test_a_python_block_parses_and_its_colograd_imports_resolve("x", "from colograd import tiny\n")


def _train_commands(code: str) -> list[list[str]]:
    """The arguments after `colograd/train.py` of each command in a shell block (continued lines joined)."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.split(" #")[0]
        if "colograd/train.py" in line:
            words = shlex.split(line)
            commands.append(words[words.index("colograd/train.py") + 1 :])
    return commands


@pytest.mark.parametrize("where, code", BASH, ids=[w for w, _ in BASH])
def test_a_shell_block_names_flags_files_and_targets_that_exist(where, code):
    for args in _train_commands(code):
        for i, word in enumerate(args):
            if word == "...":
                continue
            if word.startswith("--"):
                name = word[2:].split("=")[0]
                assert name in KNOWN_KEYS | {"config", "debug"}, f"{where}: colograd/train.py has no flag --{name}"
            if i and args[i - 1] == "--config":
                assert (ROOT / word).is_file() or word.startswith("recipes/my_"), f"{where}: no recipe {word}"
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line.split(" #")[0]) if not line.lstrip().startswith("#") else []
        if "--config_file" in words:
            assert (ROOT / words[words.index("--config_file") + 1]).is_file(), f"{where}: {line}"
        if words[:1] == ["make"] and len(words) > 1:
            assert re.search(rf"^{re.escape(words[1])}:", (ROOT / "Makefile").read_text(), re.MULTILINE), where
        if words[:3] == ["python", "-m", "colograd.bench"]:
            subcommand = next(w for w in words[3:] if not w.startswith("-"))
            assert subcommand in BENCHMARKS, f"{where}: python -m colograd.bench has no {subcommand}"


@pytest.mark.parametrize("where, code", YAML, ids=[w for w, _ in YAML])
def test_a_recipe_block_sets_only_known_keys(where, code):
    recipe = yaml.safe_load(code)
    if recipe.get("kind") == "Job":  # a Kubernetes manifest: its command's flags
        command = recipe["spec"]["template"]["spec"]["containers"][0]["command"]
        flags = [w[2:] for w in command[command.index("colograd/train.py") + 1 :] if w.startswith("--")]
        assert set(flags) <= KNOWN_KEYS | {"config"}, f"{where}: {set(flags) - KNOWN_KEYS}"
        return
    assert set(recipe) <= KNOWN_KEYS, f"{where}: unknown keys {sorted(set(recipe) - KNOWN_KEYS)}"


def test_every_page_has_blocks_checked():
    """The extraction finds the blocks (a change of fence style would silently check nothing)."""
    assert len(PYTHON) >= 7 and len(BASH) >= 15 and len(YAML) >= 6


@pytest.mark.slow
def test_the_quickstarts_python_block_runs_as_written(tmp_path):
    """docs/quickstart.md's Python block, pasted into a file and run in an empty folder: it trains and saves."""
    (code,) = [code for where, code in PYTHON if where.startswith("docs/quickstart.md")]
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env,
                         timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "out/model.safetensors").exists() and (tmp_path / "out/README.md").exists()
