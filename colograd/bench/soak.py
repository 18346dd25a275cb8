"""Failure soak: does a run survive its workers being killed, and end as if nothing had happened?

`python -m colograd.bench soak` trains the tiny default (`recipes/grpo_tiny.yaml`, its fixed seed) for `steps` steps
on `nproc` processes under `torchrun` (or `accelerate launch`), saving a checkpoint every `save_steps` steps, and
plays the scheduler of docs/long-runs.md: `failures` times it SIGKILLs one worker (a rank, never the launcher's
agent), waits for the launch to end and runs the same command again, which resumes from the run's newest finished
checkpoint by itself (`auto_resume`). After the last failure the run finishes; then the same command trains
uninterrupted into another folder, and the two are compared.

Measured for each failure, from the launches' output read line by line as it comes:

- the step it hit: the optimizer steps the launch had logged when it ended (the kill landed in the next one);
- the newest finished checkpoint then, and the one the relaunch says it resumed from (`colograd: note: resuming from`);
- the steps lost: the steps logged after that checkpoint, trained again by the relaunch (at most `save_steps`);
- the time to exit: from the kill to the launch's exit (the launcher ending the other workers);
- the time to resume: from the relaunch to its first optimizer step logged (start-up, checkpoint load, one step),
  against the uninterrupted run's time to its first step.

Overall: the failures survived, the steps trained in all (the run's plus those lost), the wall time with failures
and without, and whether the final weights are bit-identical to the uninterrupted run's (with their largest absolute
difference); where they are not, the first checkpoint whose weights differ and the first step whose logged metrics
(timings aside) differ say where the runs parted.

The kill schedule (`kill_schedule`) is drawn from its own seed, printed at the start (`--seed` replays it): the steps
1 .. steps-2 are cut into `failures` equal spans, and failure i comes in the i-th launch, a random fraction of a step
(the launch's median step time) after a random step of span i is logged, to a random rank.
"""

import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import colograd
from colograd.engine.launch import free_port
from colograd.runs.checkpoints import checkpoint_step, checkpoints, is_complete, last_complete_checkpoint

ROOT = Path(colograd.__file__).resolve().parents[1]
RECIPE = "recipes/grpo_tiny.yaml"
ACCELERATE_CONFIG = "recipes/accelerate_configs/cpu.yaml"
OUTPUT = "outputs/bench-soak"
TRAINING_SEED = 42  # the recipe's: every launch of both runs trains with it
DEFAULTS = {"steps": 400, "save_steps": 20, "failures": 3, "nproc": 2, "launcher": "torchrun"}
LAUNCHERS = ("torchrun", "accelerate")
LAUNCH_TIMEOUT_S = 1800  # the longest a launch may go without reaching what the soak waits for
STEP_LINE = "{'loss': "  # how the first rank prints each logged optimizer step (logging_steps 1)
RESUMED = re.compile(r"colograd: note: resuming from (\S+), the newest finished checkpoint")
_ERROR_LINE = re.compile(r"^(\[rank\d+\]): \w+(?:Error|Exception|Exit)\b.*$", re.M)  # a rank's exception
TIMING_PREFIXES = ("time/", "throughput/")  # logged metrics that time a step: they differ between any two runs


@dataclass(frozen=True)
class Kill:
    """One failure of the schedule: SIGKILL the worker of `rank`, `delay` of a step after step `after_step` is
    logged."""

    after_step: int
    delay: float
    rank: int


def settings(
    steps: int | None = None,
    save_steps: int | None = None,
    failures: int | None = None,
    seed: int | None = None,
    nproc: int | None = None,
    launcher: str | None = None,
) -> dict[str, Any]:
    """The soak's settings: those given, the defaults (`DEFAULTS`) for the others, and a fresh schedule seed when none
    is given.

    Raises:
        ValueError: a value the soak cannot run with, in one line naming the option.
    """
    given = {"steps": steps, "save_steps": save_steps, "failures": failures, "nproc": nproc, "launcher": launcher}
    s = {**DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    s["seed"] = random.SystemRandom().randrange(2**31) if seed is None else seed
    if s["steps"] < 2:
        raise ValueError(f"--steps {s['steps']}: give at least 2 steps.")
    if not 1 <= s["save_steps"] < s["steps"]:
        raise ValueError(
            f"--save-steps {s['save_steps']}: give from 1 to {s['steps'] - 1} (below --steps {s['steps']}), so that "
            "checkpoints are saved before the run ends."
        )
    if not 0 <= s["failures"] <= s["steps"] - 2:
        raise ValueError(
            f"--failures {s['failures']}: give from 0 to {s['steps'] - 2} (each failure comes after its own step "
            f"among steps 1 to {s['steps'] - 2} of --steps {s['steps']})."
        )
    if s["nproc"] < 1:
        raise ValueError(f"--nproc {s['nproc']}: give at least 1 process.")
    if s["seed"] < 0:
        raise ValueError(f"--seed {s['seed']}: give a seed of 0 or more.")
    if s["launcher"] not in LAUNCHERS:
        raise ValueError(f"--launcher {s['launcher']!r}: give one of {', '.join(LAUNCHERS)}.")
    return s


def kill_schedule(seed: int, steps: int, failures: int, nproc: int) -> list[Kill]:
    """The failures of a soak, in order: the steps 1 .. steps-2 cut into `failures` equal spans (so that the failures
    spread over the run and the last leaves a step before the end), a random step in each, a random fraction of a step
    after it, a random rank. The same arguments give the same schedule."""
    if failures == 0:
        return []
    rng = random.Random(seed)
    last = steps - 2
    bounds = [1 + last * i // failures for i in range(failures + 1)]
    return [
        Kill(after_step=rng.randint(bounds[i], bounds[i + 1] - 1), delay=rng.random(), rank=rng.randrange(nproc))
        for i in range(failures)
    ]


def resumed_step(line: str) -> int | None:
    """The step of the checkpoint a relaunch says it resumes from, in a line of its output; None for other lines."""
    match = RESUMED.search(line)
    if match is None:
        return None
    return int(re.search(r"checkpoint-(\d+)$", match.group(1).rstrip("/")).group(1))


def logged_steps(line: str) -> int:
    """The optimizer steps logged in a line of a launch's output (the first rank prints one dict per step)."""
    return line.count(STEP_LINE)


def steps_lost(logged: int, resumed_from: int) -> int:
    """Steps a failure costs: those logged before it, after the checkpoint the relaunch resumed from, which the
    relaunch trains again (at most the save interval when that checkpoint is the newest finished one)."""
    return logged - resumed_from


def first_divergent_step(expected: list[dict[str, Any]], got: list[dict[str, Any]]) -> int | None:
    """The first optimizer step whose logged metrics differ between two runs' `log_history`, timings aside (a step
    logged by one run only differs too); None when every step's are equal."""
    ours, theirs = _metrics_by_step(expected), _metrics_by_step(got)
    for step in sorted(ours.keys() | theirs.keys()):
        if ours.get(step) != theirs.get(step):
            return step
    return None


def _metrics_by_step(history: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {
        entry["step"]: {k: v for k, v in entry.items() if not k.startswith(TIMING_PREFIXES)}
        for entry in history
        if "loss" in entry
    }


def worker_pid(launcher: int, rank: int) -> int | None:
    """The pid of the launcher's child process that runs `rank` (its environment says so), or None."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in environ:
            return int(pid)
    return None


def command(s: dict[str, Any], output_dir: Path, port: int) -> list[str]:
    """The training command: the same for every launch of a run (a scheduler reruns it as it is)."""
    if s["launcher"] == "torchrun":
        launch = ["-m", "torch.distributed.run", "--nproc_per_node", str(s["nproc"]), "--master_port", str(port)]
    else:
        launch = ["-m", "accelerate.commands.launch", "--config_file", ACCELERATE_CONFIG,
                  "--num_processes", str(s["nproc"]), "--main_process_port", str(port)]  # fmt: skip
    train = ["colograd/train.py", "--config", RECIPE, "--seed", str(TRAINING_SEED), "--max_steps", str(s["steps"]),
             "--save_strategy", "steps", "--save_steps", str(s["save_steps"]), "--disable_tqdm", "true",
             "--output_dir", str(output_dir)]  # fmt: skip
    return [sys.executable, *launch, *train]


class Launch:
    """One launch of the command, in a session of its own: its output appended to `log` and read line by line as it
    comes, with the time each optimizer step is logged and the checkpoint it resumed from."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.resumed_from = 0
        self.step_times: list[float] = []  # time.monotonic() as each step is logged
        self._changed = threading.Condition()
        self._ended = False
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self._reader = threading.Thread(target=self._read, args=(log,), daemon=True)
        self._reader.start()

    def _read(self, log: Path) -> None:
        with open(log, "ab") as out:
            for raw in self.proc.stdout:
                now = time.monotonic()
                out.write(raw)
                out.flush()
                line = raw.decode(errors="replace")
                with self._changed:
                    if (step := resumed_step(line)) is not None:
                        self.resumed_from = step
                    self.step_times += [now] * logged_steps(line)
                    self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    @property
    def step(self) -> int:
        """The last optimizer step logged."""
        return self.resumed_from + len(self.step_times)

    def step_s(self) -> float | None:
        """The median time between two logged steps, or None before two are."""
        times = self.step_times
        return statistics.median(b - a for a, b in zip(times, times[1:], strict=False)) if len(times) > 1 else None

    def wait_for_step(self, step: int) -> bool:
        """Wait until this launch has logged a step of its own, and step `step` or a later one: True; False when the
        launch's output ends first."""
        with self._changed:
            reached = lambda: bool(self.step_times) and self.step >= step  # noqa: E731
            if not self._changed.wait_for(lambda: reached() or self._ended, timeout=LAUNCH_TIMEOUT_S):
                raise TimeoutError(f"no step {step} after {LAUNCH_TIMEOUT_S} s")
            return reached()

    def wait(self) -> int:
        """Wait for the launch to end; its exit code."""
        code = self.proc.wait(timeout=LAUNCH_TIMEOUT_S)
        self._reader.join(timeout=30)  # a process the launch left behind may hold its output open
        return code

    def stop(self) -> None:
        """End the whole launch (its session) if it still runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def fail(what: str, log: Path) -> RuntimeError:
    """The soak's error: the end of the log, and before it each rank's last error line where the end lacks it (a
    rank that died first is the cause, its traceback often scrolled off by the others' and the launcher's)."""
    text = log.read_text(errors="replace")
    tail = text[-3000:]
    last = {m.group(1): m.group(0) for m in _ERROR_LINE.finditer(text)}
    causes = "".join(f"{line}\n" for line in last.values() if line not in tail)
    return RuntimeError(f"colograd.bench soak: {what}; the end of {log}:\n{causes}{tail}")


def soak(s: dict[str, Any], schedule: list[Kill], out: Path, log: Path, port: int) -> dict[str, Any]:
    """Run the command into `out`, killing a worker at each failure of `schedule` and relaunching; the figures."""
    cmd = command(s, out, port)
    start = time.monotonic()
    launch, launches, failures = Launch(cmd, log), [], []
    step_s = 0.0  # a step's duration, the latest measured
    try:
        for n, kill in enumerate(schedule, 1):
            if not launch.wait_for_step(kill.after_step):
                raise fail(f"launch {n} ended (exit {launch.wait()}) before step {kill.after_step}", log)
            time.sleep(kill.delay * (step_s := launch.step_s() or step_s))
            pid = worker_pid(launch.proc.pid, kill.rank)
            if pid is None:
                raise fail(f"launch {n}: no worker of rank {kill.rank} under process {launch.proc.pid}", log)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            code = launch.wait()
            exited = time.monotonic()
            newest, logged = last_complete_checkpoint(str(out)), launch.step
            launches.append(launch)
            launch = Launch(cmd, log)  # the same command, as the scheduler reruns it
            if not launch.wait_for_step(0):
                raise fail(f"the relaunch after failure {n} ended (exit {launch.wait()}) before a step", log)
            failures.append({
                "killed_in_step": logged + 1,
                "rank": kill.rank,
                "launch_exit_code": code,
                "checkpoint": checkpoint_step(newest) if newest else 0,
                "resumed_from": launch.resumed_from,
                "steps_lost": steps_lost(logged, launch.resumed_from),
                "exit_s": exited - killed,
                "resume_s": launch.step_times[0] - launch.started,
            })  # fmt: skip
        if (code := launch.wait()) != 0:
            raise fail(f"the last launch ended with exit code {code}", log)
        launches.append(launch)
    finally:
        launch.stop()
    return {
        "failures": failures,
        "seconds": time.monotonic() - start,
        "steps_trained": sum(len(each.step_times) for each in launches),
    }


def uninterrupted(s: dict[str, Any], out: Path, log: Path, port: int) -> dict[str, Any]:
    """Run the command into `out` with no failure; its wall time and time to its first logged step."""
    launch = Launch(command(s, out, port), log)
    try:
        if (code := launch.wait()) != 0 or not launch.step_times:
            raise fail(f"the uninterrupted run ended with exit code {code}", log)
    finally:
        launch.stop()
    return {"seconds": time.monotonic() - launch.started, "first_step_s": launch.step_times[0] - launch.started}


def compare(expected: Path, got: Path) -> dict[str, Any]:
    """The final weights of two runs' output folders: bit-identical or not, the largest absolute difference; and, to
    say where two runs part, the first checkpoint both saved whose weights differ and the first step whose logged
    metrics differ (from their last checkpoints' `log_history`)."""
    import torch
    from safetensors.torch import load_file

    def weights(folder: Path) -> tuple[bool, float]:
        a, b = load_file(expected / folder / "model.safetensors"), load_file(got / folder / "model.safetensors")
        if a.keys() != b.keys():
            return False, float("inf")
        same = all(torch.equal(a[name], b[name]) for name in a)
        return same, max((a[n].double() - b[n].double()).abs().max().item() for n in a)

    identical, max_abs_diff = weights(Path("."))
    finished = {Path(c).name for c in checkpoints(str(expected)) if is_complete(c)}
    both = [Path(c).name for c in checkpoints(str(got)) if is_complete(c) and Path(c).name in finished]
    first_checkpoint = next((int(name.split("-")[1]) for name in both if not weights(Path(name))[0]), None)
    histories = [json.loads((folder / both[-1] / "trainer_state.json").read_text())["log_history"]
                 for folder in (expected, got)] if both else [[], []]  # fmt: skip
    step = first_divergent_step(*histories)
    return {
        "bit_identical": identical,
        "max_abs_diff": max_abs_diff,
        "first_divergent_checkpoint": first_checkpoint,
        "metrics_identical": step is None,
        "first_divergent_step": step,
        "compared_through_step": int(both[-1].split("-")[1]) if both else None,
    }


def run(
    steps: int = DEFAULTS["steps"],
    save_steps: int = DEFAULTS["save_steps"],
    failures: int = DEFAULTS["failures"],
    seed: int | None = None,
    nproc: int = DEFAULTS["nproc"],
    launcher: str = DEFAULTS["launcher"],
    as_json: bool = False,
) -> dict[str, Any]:
    """The soak with failures, then the uninterrupted run, then their comparison; prints a table (or one JSON line)
    and writes the JSON to outputs/bench-soak/result.json."""
    s = settings(steps, save_steps, failures, seed, nproc, launcher)
    schedule = kill_schedule(s["seed"], s["steps"], s["failures"], s["nproc"])
    folder = Path(OUTPUT).resolve()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    out, reference = folder / "with-failures", folder / "uninterrupted"
    port = free_port()
    load_before = os.getloadavg()[0]
    print(f"colograd.bench soak: schedule seed {s['seed']} (--seed {s['seed']} replays it): "
          + "; ".join(f"rank {k.rank} killed {k.delay:.2f} of a step after step {k.after_step}" for k in schedule),
          file=sys.stderr, flush=True)  # fmt: skip
    print(f"colograd.bench soak: {shlex.join(command(s, out, port))}\n  (in {ROOT}), logs in {folder}/*.log...",
          file=sys.stderr, flush=True)  # fmt: skip
    with_failures = soak(s, schedule, out, folder / "with-failures.log", port)
    plain = uninterrupted(s, reference, folder / "uninterrupted.log", port)
    lost = [f["steps_lost"] for f in with_failures["failures"]]
    resume = [f["resume_s"] for f in with_failures["failures"]]
    result = {
        **s,
        "schedule": [asdict(k) for k in schedule],
        "failures_survived": len(with_failures["failures"]),
        "failure_details": with_failures["failures"],
        "steps_lost": lost,
        "steps_lost_total": sum(lost),
        "steps_lost_max": max(lost, default=0),
        "steps_trained": with_failures["steps_trained"],
        "resume_s": resume,
        "resume_s_median": statistics.median(resume) if resume else None,
        "fresh_first_step_s": plain["first_step_s"],
        "with_failures_s": with_failures["seconds"],
        "uninterrupted_s": plain["seconds"],
        **compare(reference, out),
        "output_dir": str(folder),
        "load_average_1min_before": load_before,
        "load_average_1min": os.getloadavg()[0],
    }
    (folder / "result.json").write_text(json.dumps(result) + "\n")
    print(json.dumps(result) if as_json else report(result))
    return result


def report(r: dict[str, Any]) -> str:
    """The figures of `run` as a table."""
    lines = [
        f"Failure soak: {r['steps']} steps of {RECIPE} on {r['nproc']} processes under {r['launcher']}, a checkpoint "
        f"every {r['save_steps']} steps; {r['failures']} failures (schedule seed {r['seed']})",
        "  failure  killed in step  rank  checkpoint then  resumed from  steps lost  exit (s)  resume (s)",
    ]
    for n, f in enumerate(r["failure_details"], 1):
        lines.append(
            f"  {n:7d}  {f['killed_in_step']:14d}  {f['rank']:4d}  {f['checkpoint']:15d}  {f['resumed_from']:12d}  "
            f"{f['steps_lost']:10d}  {f['exit_s']:8.1f}  {f['resume_s']:10.1f}"
        )
    lines.append(
        f"  failures survived: {r['failures_survived']} of {r['failures']}; steps lost {r['steps_lost_total']} in "
        f"all, at most {r['steps_lost_max']} for one (save interval {r['save_steps']}); steps trained "
        f"{r['steps_trained']} for a run of {r['steps']}"
    )
    if r["resume_s"]:
        lines.append(
            f"  time to resume (relaunch to its first step): median {r['resume_s_median']:.1f} s "
            f"({min(r['resume_s']):.1f}-{max(r['resume_s']):.1f}); a fresh start to its first step: "
            f"{r['fresh_first_step_s']:.1f} s"
        )
    lines.append(
        f"  wall time: {r['with_failures_s']:.0f} s with failures, {r['uninterrupted_s']:.0f} s uninterrupted"
    )
    if r["bit_identical"]:
        verdict = "yes (largest absolute weight difference 0.0)"
    else:
        verdict = (
            f"no: largest absolute weight difference {r['max_abs_diff']:.3g}; first checkpoint whose weights differ: "
            f"{r['first_divergent_checkpoint']}"
        )
    step = r["first_divergent_step"]
    metrics = "identical at every step" if step is None else f"first differ at step {step}"
    if step is not None and r["bit_identical"]:  # e.g. other batches, on which both runs' gradients were zero
        metrics += " (the weights agree all the same: where every group's rewards are equal, the gradient is zero)"
    lines += [
        f"  bit-identical to the uninterrupted run: {verdict}",
        f"  logged metrics (timings aside), through step {r['compared_through_step']}: {metrics}",
        f"  machine load (1-minute average): {r['load_average_1min_before']:.1f} at the start, "
        f"{r['load_average_1min']:.1f} at the end, on {os.cpu_count()} CPUs; output in {r['output_dir']}",
    ]
    return "\n".join(lines)
