"""The one launch the long-tail features' 2-rank tests share (tests/scripts/longtail_check.py): dynamic sampling and
partial rollouts each train on 2 ranks under ZeRO-3, one after the other in the same processes."""

import json
from pathlib import Path

_DONE: dict[str, Path] = {}


def longtail_runs(tmp_path_factory, feature: str) -> list[dict]:
    """Each rank's record of `feature`'s run ("dynamic" or "partial"), launching both runs at the first call."""
    from conftest import launch

    if "out" not in _DONE:
        out = tmp_path_factory.mktemp("longtail")
        proc = launch("tests/scripts/longtail_check.py", str(out), config="tests/configs/zero3_cpu.yaml",
                      env={"DS_ACCELERATOR": "cpu"}, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        _DONE["out"] = out
    return [json.loads((_DONE["out"] / feature / f"rank{r}.json").read_text()) for r in range(2)]
