"""How the GPU check (`colograd.gpu.check`) runs its rows: each in a child process that writes its `Result` as JSON,
read back here, and the table they make.

A row runs in a fresh interpreter because vLLM never gives an engine's GPU memory back inside a process; a child
that crashes, hangs or writes nothing becomes a FAIL row with the last line it wrote, so one broken row never
hides the others.
"""

import json
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

ROW_TIMEOUT_S = 900
# A row that starts with this much less free GPU memory than the first one suggests an earlier row leaked.
LEAK_GIB = 1.0


@dataclass
class Result:
    """One row of the table: `status` is pass, FAIL or skip; `detail` gives the figures or the reason.

    `figures` holds the row's numbers for a program (the table shows `detail`); `free_gib` is the GPU memory
    free when the row's process started, None where the row ran in the checking process or without a GPU.
    """

    name: str
    status: str
    detail: str
    figures: dict[str, float] = field(default_factory=dict)
    free_gib: float | None = None


def write_result(result: Result, path: str) -> None:
    """The child's side: its row's result, as JSON, where the parent reads it (`read_result`)."""
    with open(path, "w") as f:
        json.dump(asdict(result), f)


def read_result(path: str) -> Result:
    with open(path) as f:
        return Result(**json.load(f))


def run_child(name: str, cmd: list[str], read: Callable[[], Result], timeout: float = ROW_TIMEOUT_S) -> Result:
    """Run the row `name` as the command `cmd` and build its result with `read` once the command has ended.

    A command that runs past `timeout` seconds, or ends without the output `read` needs (missing, or cut short:
    `read` raises `FileNotFoundError`, `ValueError`, `KeyError` or `TypeError`), is a FAIL row with the last line it
    wrote; one that wrote its result and then exited with an error (at teardown)
    is a FAIL row with its figures and that line.
    """
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        return Result(name, "FAIL", f"timed out after {timeout:.0f} s: {last_line(_text(err.stderr))}")
    try:
        result = read()
    except (FileNotFoundError, ValueError, KeyError, TypeError):  # none written, or cut short by a crash
        return Result(name, "FAIL", f"exit {proc.returncode}: {last_line(proc.stderr or proc.stdout)}")
    if proc.returncode != 0:
        result.status = "FAIL"
        result.detail += f"; then exit {proc.returncode}: {last_line(proc.stderr)}"
    return result


def format_table(results: list[Result]) -> str:
    """The results as a fixed-width table, one row per check (with the GPU memory free when its process started),
    a closing count, and a line naming rows that started with much less free memory than the first."""
    width = max(len(r.name) for r in results)
    rows = [f"{'check':<{width}}  result  free GiB  figures"]
    for r in results:
        free = f"{r.free_gib:.1f}" if r.free_gib is not None else "-"
        rows.append(f"{r.name:<{width}}  {r.status:<6}  {free:>8}  {r.detail}")
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "FAIL", "skip")}
    rows.append(f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped")
    return "\n".join(rows + leak_lines(results))


def leak_lines(results: list[Result]) -> list[str]:
    """One line when some row's process started with `LEAK_GIB` less free GPU memory than the first row's."""
    measured = [r for r in results if r.free_gib is not None]
    if not measured:
        return []
    first = measured[0].free_gib
    short = [f"{r.name} ({first - r.free_gib:.1f} GiB less)" for r in measured if first - r.free_gib > LEAK_GIB]
    if not short:
        return [f"every row started within {LEAK_GIB:.0f} GiB of the first row's free GPU memory ({first:.1f} GiB)"]
    return [f"started with less free GPU memory than the first row (a leak?): {', '.join(short)}"]


def last_line(text: str) -> str:
    """The last non-blank line of a child's output, cut to 200 characters: what a FAIL row shows."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _text(output: str | bytes | None) -> str:
    """What a timed-out child wrote: `TimeoutExpired` may carry bytes even for a text-mode run."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""
