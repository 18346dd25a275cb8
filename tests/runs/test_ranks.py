"""Collectives that let go of their tensors before they return (`colograd.runs.ranks.all_reduce_settled`), under a
real 2-process launch over gloo.

A gloo all-reduce returns before its worker thread has let go of the tensor (about one call in five on 2 cores);
where the caller drops the tensor first, the worker frees it, which needs the interpreter's lock, and if the process
is exiting by then Python ends the worker inside torch and the process aborts: a finished run's launch failed that
way. The plain all-reduce is measured alongside (not asserted: how often its worker is late depends on the machine's
load), so that a failure shows the race as it is there.
"""

import json

import pytest
from conftest import launch

pytestmark = pytest.mark.slow  # a 2-process launch


def test_a_settled_all_reduce_returns_with_the_caller_its_tensors_only_holder(tmp_path):
    proc = launch("tests/scripts/settled_reduce.py", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["settled"]["right"] and record["plain"]["right"]
        late = sum(h > 1 for h in record["plain"]["holders"])
        assert set(record["settled"]["holders"]) == {1}, f"plain all-reduces returned held: {late} of {CALLS}"


CALLS = 300  # tests/scripts/settled_reduce.py's
