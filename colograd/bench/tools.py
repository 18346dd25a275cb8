"""Agent rollouts: colograd's per-request loop against a turn-by-turn loop like TRL's, same engine, same workload.

The workload: P prompts × G completions of the tiny model, each its own trajectory. A turn that ends with one of
three characters calls a tool whose latency is drawn, seeded by the call, uniformly in 0–300 ms (a search, a code
run); its result goes back in and the model goes on, up to `max_completion_length` tokens per trajectory.

- per request (`colograd.agents.core.AgentLoop`): every trajectory is its own engine request; a tool runs while the
  others decode, and its continuation rejoins the running batch.
- lockstep (TRL 1.16's `_tool_call_loop`): generate every row, run the tools of all rows that called one, then
  re-generate only those rows as one batch, turn after turn: each turn waits for its slowest tool and longest row.
  Its tools run concurrently (TRL runs a row's sync tools one after another), so the comparison is of scheduling
  alone.

Both loops use the same per-request seeds, turn logic and tools, so they build the same trajectories (the
benchmark reports how many came out identical; batch composition can change a float's last bits and so a
sample). Repeated alternately; medians are reported.
"""

import json
import random
import statistics
import tempfile
import time
from typing import Any

import torch

from colograd.agents.core import AgentLoop, Trajectory, turn_params, turn_sampling_params
from colograd.agents.tools import ToolCall, ToolRunner, plain_result_ids
from colograd.engine.core import Engine
from colograd.engine.sync import WeightPlan
from colograd.models import tiny

MAX_LATENCY_S = 0.3


class SlowTools:
    """One tool per marker character; a call's latency is seeded by its text, so both loops wait the same."""

    MARKERS = {";": "search", "?": "run_code", "!": "lookup"}

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.stop = list(self.MARKERS)
        self.tools = {name: self._tool(name) for name in self.MARKERS.values()}

    def parse(self, text: str) -> list[ToolCall]:
        name = self.MARKERS.get(text[-1:])
        return [ToolCall(name, {"text": text[:-1]})] if name else []

    def _tool(self, name: str):
        def tool(text: str) -> str:
            rng = random.Random(f"{self.seed}:{name}:{text}")
            time.sleep(rng.uniform(0.0, MAX_LATENCY_S))
            return str(len(text) % 10)

        return tool


def per_request(loop: AgentLoop, trajectories: list[Trajectory], params: Any) -> None:
    """colograd's schedule: every trajectory its own request, tools beside the decoding."""
    loop.run(trajectories, params)


def lockstep(loop: AgentLoop, trajectories: list[Trajectory], params: Any) -> None:
    """TRL's schedule: all rows, then only the rows that called a tool, one batch per turn."""
    active = list(range(len(trajectories)))
    while active:
        prompts = [{"prompt_token_ids": trajectories[i].prompt_ids + trajectories[i].ids} for i in active]
        per_row = [turn_params(params, trajectories[i], loop.max_completion_length) for i in active]
        outputs = loop.requests.generate(prompts, per_row)
        pending = {}
        for i, output in zip(active, outputs, strict=True):
            calls = loop.end_turn(trajectories[i], output.outputs[0])
            if calls:
                pending[i] = loop.runner.submit(trajectories[i].tools, calls)
        while not all(p.ready() for p in pending.values()):  # the turn waits for its slowest tool
            time.sleep(0.001)
        active = [i for i, p in pending.items() if loop.insert_results(trajectories[i], p.results())]


def run(prompts: int = 16, group: int = 8, length: int = 64, repeats: int = 3, as_json: bool = False) -> dict:
    torch.manual_seed(0)
    model, tokenizer = tiny.build_model().eval(), tiny.build_tokenizer()
    n = prompts * group
    with tempfile.TemporaryDirectory() as out:
        args = tiny.run_config(out, 1, per_device_train_batch_size=n, num_generations=group,
                               max_completion_length=length, vllm_max_num_seqs=n, vllm_kv_cache_gib=0.5)  # fmt: skip
        engine = Engine(model, tokenizer, args)
    WeightPlan(model).sync(engine)
    tools = SlowTools(seed=0)
    runner = ToolRunner(timeout=10.0)
    # the turns' log-probs through the engine's sampler tap, as a training rollout reads them
    loop = AgentLoop(engine.requests(tap=True), tokenizer, tools, plain_result_ids(tokenizer), runner, length)
    params = turn_sampling_params(args, tools.stop)
    dataset = tiny.letters_dataset(prompts, seed=1)
    prompt_ids = [tokenizer(row["prompt"])["input_ids"] for row in dataset]

    def trajectories() -> list[Trajectory]:
        return [Trajectory(prompt_ids[i // group], tools.tools, seed=1000 + i) for i in range(n)]

    def timed(schedule) -> tuple[float, list[Trajectory]]:
        done = trajectories()
        engine.reset_prefix_cache()  # each run starts cold, as a rollout after a weight sync does
        start = time.perf_counter()
        schedule(loop, done, params)
        return time.perf_counter() - start, done

    timed(per_request)  # warm-up: the first engine steps allocate
    times: dict[str, list[float]] = {"per_request": [], "lockstep": []}
    for _ in range(repeats):
        seconds, scheduled = timed(per_request)
        times["per_request"].append(seconds)
        seconds, turn_by_turn = timed(lockstep)
        times["lockstep"].append(seconds)
    runner.close()
    sampled = sum(sum(t.tool_mask) for t in scheduled)
    calls = sum(t.calls for t in scheduled)
    per_request_s, lockstep_s = statistics.median(times["per_request"]), statistics.median(times["lockstep"])
    result = {
        "trajectories": n,
        "tool_calls": calls,
        "tool_calls_lockstep": sum(t.calls for t in turn_by_turn),
        "identical_trajectories": sum(a.ids == b.ids for a, b in zip(scheduled, turn_by_turn, strict=True)),
        "turns_max": max(t.turns for t in scheduled),
        "sampled_tokens": sampled,
        "per_request_s": per_request_s,
        "lockstep_s": lockstep_s,
        "speedup_vs_lockstep": lockstep_s / per_request_s,
        "per_request_tokens_per_s": sampled / per_request_s,
        "lockstep_tokens_per_s": sum(sum(t.tool_mask) for t in turn_by_turn) / lockstep_s,
        "repeats": repeats,
    }
    if as_json:
        print(json.dumps(result))
    else:
        print_table(result)
    return result


def print_table(r: dict) -> None:
    print(f"{r['trajectories']} trajectories, {r['tool_calls']} tool calls (lockstep: {r['tool_calls_lockstep']}), "
          f"up to {r['turns_max']} turns, {r['identical_trajectories']} identical in both loops; "
          f"tool latency 0-{MAX_LATENCY_S * 1000:.0f} ms; medians of {r['repeats']}")  # fmt: skip
    print(f"per request  {r['per_request_s']:7.2f} s  {r['per_request_tokens_per_s']:8.1f} sampled tokens/s")
    print(f"lockstep     {r['lockstep_s']:7.2f} s  {r['lockstep_tokens_per_s']:8.1f} sampled tokens/s")
    print(f"speedup_vs_lockstep {r['speedup_vs_lockstep']:.2f}")
