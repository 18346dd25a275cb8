"""The docs notebook runs top to bottom: a subclass overriding one stage trains the tiny model on CPU."""

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # the notebook trains in a kernel process, with an engine


def test_custom_advantages_notebook_runs(root, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the kernel inherits this: nothing may download
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's output folder (mkdtemp) is removed with the test's
    # An engine started earlier in this test process left its launcher variables here (its port still in use):
    # the kernel is a fresh single process and must pick its own.
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    notebook = nbformat.read(root / "docs/notebooks/custom_advantages.ipynb", as_version=4)
    # Raises on the first cell that fails, including the notebook's own check that the reward rose.
    client = NotebookClient(notebook, timeout=600, kernel_name="python3")
    client.execute(cwd=str(tmp_path))

    outputs = [
        "".join(out.get("text", "") + out.get("data", {}).get("text/plain", "") for out in cell.outputs)
        for cell in notebook.cells
        if cell.cell_type == "code"
    ]
    hand_checked = next(text for text in outputs if text.startswith("tensor("))
    assert hand_checked.split() == "tensor([-1., 0., 0., 1., 0., 0., 0., 0.])".split()
    assert any("tags:\n- colograd\n- grpo" in text for text in outputs)  # the saved model card
