"""Agentic rollouts on the colocated engine, scheduled per request.

Every trajectory (one per completion: B prompts × G samples) is its own engine request. When one stops at a tool
call, its tools start (`colograd.agents.tools.ToolRunner`) while the engine keeps decoding the others; when its results
are in, the trajectory goes back into the running batch as a new request whose prompt is the same token ids so far
plus the result's tokens, so the engine reuses its cached prefix. No trajectory waits for another's tool.

Token in, token out: a trajectory's completion is the tokens the engine sampled, turn after turn, with the tool
results' tokens between them, exactly as they were given to the engine; nothing is re-tokenized from text.
`tool_mask` is 1 on the sampled tokens and 0 on the inserted ones, and every sampled token keeps the engine's
log-prob (0.0 stands in for inserted tokens, which are masked out).

Length: `max_completion_length` bounds the whole completion, sampled and inserted tokens together. Each turn may
sample what is left of it; a tool result that would leave no room for the model's next token is not inserted,
and the trajectory ends there, truncated (as TRL drops an overlong tool result).
"""

import concurrent.futures
import inspect
import logging
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase
from transformers.utils import get_json_schema

from colograd.agents.tools import (
    HermesToolParser,
    ToolCall,
    ToolCallParser,
    ToolResult,
    ToolRunner,
    chat_template_result_ids,
    plain_result_ids,
    tool_messages,
)
from colograd.config.core import ConfigError, GRPOConfig
from colograd.engine.requests import Requests, sampled_logps, sampling_params
from colograd.engine.rollout import Rollout, RolloutContext
from colograd.engine.routing import UNKNOWN, ReturnedRouting, RoutingCapture
from colograd.engine.sampler_tap import RANDOM_SUFFIX, SamplerTap

logger = logging.getLogger(__name__)

RolloutFunc = Callable[[list, Any], dict[str, list]]


@dataclass
class Trajectory:
    """One completion being built, turn by turn.

    prompt_ids: the prompt's token ids. tools: the tools this trajectory may call, by name.
    seed: the sampling seed of its first turn (later turns derive theirs from it); None: the engine's generator.
    ids, logps, tool_mask: the completion so far, the engine's log-prob of each token (0.0 on inserted ones; NaN
    on sampled ones it could not score), and 1 / 0 for sampled / inserted tokens. turns: model turns; calls,
    failures: tool calls made and failed.
    truncated: it ended without finishing (length, an unanswered tool call, or no room for a result).
    """

    prompt_ids: list[int]
    tools: dict[str, Callable]
    seed: int | None = None
    ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    turns: int = 0
    calls: int = 0
    failures: int = 0
    truncated: bool = False

    def add_sampled(self, token_ids: list[int], logps: list[float]) -> None:
        self.ids += token_ids
        self.logps += logps
        self.tool_mask += [1] * len(token_ids)
        self.turns += 1

    def add_inserted(self, token_ids: list[int]) -> None:
        self.ids += token_ids
        self.logps += [0.0] * len(token_ids)
        self.tool_mask += [0] * len(token_ids)


@dataclass
class Turn:
    """One finished model turn: its engine request, its trajectory, where its tokens start in the trajectory's
    completion and how many it sampled."""

    request_id: str
    trajectory: Trajectory
    start: int
    length: int
    routed: torch.Tensor | None = None  # the routing vLLM returned with it (`ReturnedRouting`), [prompt + length]

    @property
    def token_ids(self) -> list[int]:
        return self.trajectory.ids[self.start : self.start + self.length]

    @property
    def prompt_ids(self) -> list[int]:
        """The turn's prompt: the trajectory's prompt and its completion before the turn."""
        return self.trajectory.prompt_ids + self.trajectory.ids[: self.start]

    @property
    def prompt_len(self) -> int:
        """The length of the turn's prompt: the trajectory's prompt and its completion before the turn."""
        return len(self.trajectory.prompt_ids) + self.start


class AgentLoop:
    """Drives a vLLM engine request by request (add requests, step, collect finished ones) and runs tools as
    trajectories ask for them.

    Args:
        requests: the engine as a loop that drives its own requests sees it (`Engine.requests`): every request is
            served with its adapter and cache salt, and where it has a sampler tap, the turns' log-probs are read
            from the sampler as tensors (vLLM builds no per-token objects for them).
        tokenizer: decodes a turn's tokens for the parser.
        parser: finds tool calls in a turn's text; its `stop` strings end a turn besides the end-of-turn token.
        result_ids: the tokens a turn's tool messages are inserted as
        (`colograd.agents.tools.chat_template_result_ids`).
        runner: runs the tools.
        max_completion_length: bound of a whole completion, sampled and inserted tokens.
        max_tool_calling_iterations: turns that may call tools per trajectory; None: unbounded (TRL's meaning).
        routing: where the rollout is replayed (`routing_replay: rollout`), how the engine reports its routing
            (`Engine.routing_capture`): `run` then returns each trajectory's.
    """

    def __init__(
        self,
        requests: Requests,
        tokenizer: PreTrainedTokenizerBase,
        parser: ToolCallParser,
        result_ids: Callable[[list[dict]], list[int]],
        runner: ToolRunner,
        max_completion_length: int,
        max_tool_calling_iterations: int | None = None,
        routing: RoutingCapture | ReturnedRouting | None = None,
    ) -> None:
        self.requests, self.tokenizer, self.parser = requests, tokenizer, parser
        self.result_ids, self.runner = result_ids, runner
        self.max_completion_length = max_completion_length
        self.max_tool_calling_iterations = max_tool_calling_iterations
        self.routing = routing

    def run(
        self, trajectories: list[Trajectory], params: Any, on_finished: Callable[[int], None] | None = None
    ) -> list[torch.Tensor] | None:
        """Complete every trajectory in place. `params`: the `SamplingParams` of a turn (n=1); each request gets a
        copy with its own seed and the length left to its trajectory. `on_finished(i)` is called as trajectory i
        completes, while the others go on (with the tap, the log-probs are filled in once all have).

        Returns:
            With `routing`, each trajectory's routing (`trajectory_routes`); else None.
        """
        tap = self.requests.tap if self.requests.tap is not None and self.requests.tap.installed else None
        turns: list[Turn] = []
        if isinstance(self.routing, RoutingCapture):  # every position of the rollout is computed inside the capture
            self.requests.llm.reset_prefix_cache()
        recording = self.routing.capturing() if self.routing is not None else nullcontext()
        with tap.capturing() if tap is not None else nullcontext(), recording:
            self._step(trajectories, params, on_finished or (lambda i: None), turns)
        if tap is not None:
            self._read_tap(tap, turns)
        return trajectory_routes(self.routing, trajectories, turns) if self.routing is not None else None

    def _step(
        self,
        trajectories: list[Trajectory],
        params: Any,
        finished: Callable[[int], None],
        turns: list[Turn],
    ) -> None:
        """`run`'s loop: step the engine, end turns, run their tools and add the next turns, until every trajectory
        is complete; records each finished turn in `turns`."""
        engine = self.requests
        waiting: dict[int, Any] = {}  # trajectory index -> its running tool calls
        for i, trajectory in enumerate(trajectories):
            self._add(i, trajectory, params)
        while engine.unfinished() or waiting:
            if engine.unfinished():
                for output in engine.step():
                    if output.finished:
                        i = int(output.request_id.split(".")[0])
                        sample, trajectory = output.outputs[0], trajectories[i]
                        turn = Turn(output.request_id, trajectory, len(trajectory.ids), len(sample.token_ids))
                        if isinstance(self.routing, ReturnedRouting):
                            turn.routed = self.routing.routes(sample, turn.prompt_len)
                        turns.append(turn)
                        calls = self.end_turn(trajectories[i], output.outputs[0])
                        if calls:
                            waiting[i] = self.runner.submit(trajectories[i].tools, calls)
                        else:
                            finished(i)
            else:  # every live trajectory is waiting for a tool: sleep until one returns or times out
                _wait_for_any(waiting.values())
            for i in [i for i, pending in waiting.items() if pending.ready()]:
                if self.insert_results(trajectories[i], waiting.pop(i).results()):
                    self._add(i, trajectories[i], params)
                else:
                    finished(i)

    def _read_tap(self, tap: SamplerTap, turns: list[Turn]) -> None:
        """Put the tap's log-probs of each turn's tokens in place of their NaN. Where the tap missed them (vLLM built
        no objects either), they stay NaN, read as tokens the engine could not score: the turns cannot be sampled
        again, their tools have run. The tap is then uninstalled: later rollouts read the objects."""
        logps = tap.request_logps([(turn.request_id, turn.token_ids, turn.prompt_len) for turn in turns])
        if logps is None:
            logger.warning("colograd: the sampler tap missed an agent rollout's log-probs; they are NaN (unscored).")
            tap.uninstall()
            return
        for turn, found in zip(turns, logps, strict=True):
            turn.trajectory.logps[turn.start : turn.start + turn.length] = found

    def _add(self, i: int, trajectory: Trajectory, params: Any) -> None:
        ids = trajectory.prompt_ids + trajectory.ids
        self.requests.add(f"{i}.{trajectory.turns}", ids, turn_params(params, trajectory, self.max_completion_length))

    def end_turn(self, trajectory: Trajectory, sample: Any) -> list[ToolCall]:
        """Add a finished request's tokens to its trajectory. Returns the tool calls to run before the next turn;
        none when the trajectory is complete."""
        ids = list(sample.token_ids)
        trajectory.add_sampled(ids, sampled_logps(sample))  # NaN where the sampler tap reads them
        if sample.finish_reason == "length":
            trajectory.truncated = True
            return []
        calls = self.parser.parse(self.tokenizer.decode(ids))
        limit = self.max_tool_calling_iterations
        if calls and limit is not None and trajectory.turns > limit:
            trajectory.truncated = True  # it asked for a tool it may no longer call
            return []
        return calls

    def insert_results(self, trajectory: Trajectory, results: list[ToolResult]) -> bool:
        """Count a turn's results and insert their tokens; False when there is no room left for them (the
        trajectory then ends, truncated)."""
        trajectory.calls += len(results)
        trajectory.failures += sum(r.failed for r in results)
        ids = self.result_ids(tool_messages(results))
        if len(trajectory.ids) + len(ids) >= self.max_completion_length:
            trajectory.truncated = True
            return False
        trajectory.add_inserted(ids)
        return True


def trajectory_routes(
    routing: RoutingCapture | ReturnedRouting, trajectories: list[Trajectory], turns: list[Turn]
) -> list[torch.Tensor]:
    """Each trajectory's routing, [prompt + completion, layers, top_k]: every position as the engine routed it in
    whichever of its turns' requests computed it first (a turn's prompt is the trajectory so far: the tokens of the
    turns before, computed as they were sampled, and the tool results, computed by the next turn's prefill, or read
    from the prefix another request cached), `UNKNOWN` where none did (the last sampled token, tool results that no
    turn followed). The turns' routing is the capture's (`RoutingCapture.routes`, over every turn at once, so that a
    prompt read from another trajectory's cached prefix takes its routing) or vLLM's own (`ReturnedRouting`)."""
    if isinstance(routing, RoutingCapture):
        requests = [(RANDOM_SUFFIX.sub("", turn.request_id), turn.prompt_ids, turn.length) for turn in turns]
        for turn, routed in zip(turns, routing.routes(requests), strict=True):
            turn.routed = routed
    out = []
    for trajectory in trajectories:
        own = [t for t in turns if t.trajectory is trajectory]
        routed = torch.full((len(trajectory.prompt_ids) + len(trajectory.ids), *own[0].routed.shape[1:]), UNKNOWN,
                            dtype=torch.int16)  # fmt: skip
        for turn in own:  # the first turn to have computed a position gives its routing
            end = min(routed.size(0), turn.routed.size(0))
            missing = routed[:end, 0, 0] == UNKNOWN
            routed[:end][missing] = turn.routed[:end][missing]
        out.append(routed)
    return out


def _group_reporter(
    trajectories: list[Trajectory], g: int, on_group: Callable[[int, list[list[int]]], None] | None
) -> Callable[[int], None] | None:
    """`AgentLoop.run`'s `on_finished` that calls `on_group(row, ids)` once all G trajectories of a row are
    complete."""
    if on_group is None:
        return None
    left = [g] * (len(trajectories) // g)

    def finished(i: int) -> None:
        row = i // g
        left[row] -= 1
        if left[row] == 0:
            on_group(row, [t.ids for t in trajectories[row * g : (row + 1) * g]])

    return finished


def turn_params(params: Any, trajectory: Trajectory, max_completion_length: int) -> Any:
    """A copy of `params` for the trajectory's next turn: what is left of the length, and a seed of its own.

    A seed per request, different for every turn: vLLM's CPU sampler otherwise draws from the process's global
    generator, so a shared seed would make the samples of a prompt identical, and a reused one would make a
    continuation repeat the random draws of its first turn.
    """
    out = params.clone()
    out.max_tokens = max_completion_length - len(trajectory.ids)
    out.seed = None if trajectory.seed is None else (trajectory.seed + 7919 * trajectory.turns) % 2**31
    return out


def turn_sampling_params(args: Any, stop: list[str]) -> Any:
    """The `SamplingParams` of one turn: the run's sampling settings (`colograd.engine.requests.sampling_params`)
    for one sample, stopping also at the parser's `stop` strings (kept in the output), output only when finished."""
    from vllm.sampling_params import RequestOutputKind

    return sampling_params(
        args, n=1, stop=stop, include_stop_str_in_output=True, output_kind=RequestOutputKind.FINAL_ONLY
    )


def _wait_for_any(waiting: Any) -> None:
    futures = [f for pending in waiting for f in pending.futures if f is not None and not f.done()]
    timeout = max(0.0, min(p.deadline for p in waiting) - time.monotonic())
    if futures:
        concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)


class Agents:
    """Agentic rollouts for `GRPOTrainer`, with TRL's API: `tools`, `environment_factory` and `rollout_func`.

    Args:
        tokenizer: the policy's tokenizer; its chat template shows the tools to the model and frames their results.
        args: the run's config (lengths, sampling, `max_tool_calling_iterations`, `tool_timeout`, seed).
        tools: functions (or coroutine functions) the model may call; their JSON schemas come from their signatures
            and docstrings.
        environment_factory: makes one environment per completion (instances are kept and reset for later rollouts).
            `reset(**row)` may return text added to the prompt's last message; its public methods are tools;
            an optional `get_reward()` scores the finished completion (a reward function named after the class).
            Or a dict of such factories by name: each row's `environment` field picks one, and only that
            environment's tools (besides `tools`) are shown in the row's prompt (TRL's multi-environment runs).
        rollout_func: ``rollout_func(prompts, trainer) -> dict`` replaces generation: it gets each prompt G times and
            returns ``prompt_ids``, ``completion_ids`` and ``logprobs`` (one list per completion), optionally
            ``env_mask`` (0 on tokens the model did not sample); other keys reach the reward functions.
        parser: reads tool calls from the model's text; default: the Qwen / Hermes chat-template format.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        args: GRPOConfig,
        tools: list[Callable] | None = None,
        environment_factory: Callable[[], Any] | dict[str, Callable[[], Any]] | None = None,
        rollout_func: RolloutFunc | None = None,
        parser: ToolCallParser | None = None,
    ) -> None:
        if args.vllm_tensor_parallel_size > 1:
            raise ConfigError(
                "tools, environment_factory and rollout_func do not support vllm_tensor_parallel_size > 1 (the ranks "
                "of one engine would have to schedule tool turns identically); set it to 1."
            )
        self.tokenizer, self.args, self.rollout_func = tokenizer, args, rollout_func
        self.tools = {func.__name__: func for func in tools or []}
        # {name: factory}; one factory is the dict of one, named None, that every row uses (TRL's normalisation).
        self._multi = isinstance(environment_factory, dict)
        factories = environment_factory if self._multi else {None: environment_factory} if environment_factory else {}
        self._factories: dict[str | None, Callable[[], Any]] = dict(factories)
        self._pools = {name: [factory()] for name, factory in self._factories.items()}  # the probes seed the pools
        self._env_tools = {name: _environment_tools(pool[0]) for name, pool in self._pools.items()}
        try:
            standalone = [get_json_schema(func) for func in self.tools.values()]
            self._env_schemas = {
                name: standalone + [get_json_schema(getattr(pool[0], tool)) for tool in self._env_tools[name]]
                for name, pool in self._pools.items()
            }
        except Exception as e:
            raise ConfigError(f"tools: {e} (a tool needs type hints and a docstring with an Args section)") from e
        # The schemas a prompt is first rendered with: with several environments, every one's (TRL's union), until
        # each rollout's prompt is rendered again with only its own environment's.
        every = [schema for schemas in [standalone, *self._env_schemas.values()] for schema in schemas]
        self.schemas = list({schema["function"]["name"]: schema for schema in every}.values())
        if self.schemas and parser is None and not tokenizer.chat_template:
            raise ConfigError(
                "tools: the tokenizer has no chat template to show them to the model; use one that has, or pass a "
                "tool_call_parser (e.g. colograd.agents.tools.MarkerToolParser)."
            )
        self.parser = parser or HermesToolParser()
        self.result_ids = (
            chat_template_result_ids(tokenizer, args.chat_template_kwargs)
            if tokenizer.chat_template
            else plain_result_ids(tokenizer)
        )
        self.runner = ToolRunner(args.tool_timeout)
        # One reward function per environment class that owns a reward (a class under two names counts once).
        rewarded = dict.fromkeys(
            type(p[0]) for p in self._pools.values() if callable(getattr(p[0], "get_reward", None))
        )
        self.reward_funcs = [_environment_reward(env_type) for env_type in rewarded]

    def check_stages(self, trainer_class: type) -> None:
        """Refuse a subclass's `prepare_prompts` that takes no `tools` where environments re-template their prompts
        with their own tool schemas (`_template` passes them): the call would fail at the first tool turn."""
        if not self._factories or "tools" in inspect.signature(trainer_class.prepare_prompts).parameters:
            return
        raise ConfigError(
            f"{trainer_class.__name__}.prepare_prompts takes no `tools` argument, but environment_factory's "
            "environments template their prompts again with their own tool schemas; add `tools=None` to its "
            "parameters and pass it on (`super().prepare_prompts(rows, tools)`)."
        )

    def generate(
        self,
        trainer: Any,
        prompt_ids: list[list[int]],
        context: RolloutContext,
        on_group: Callable[[int, list[list[int]]], None] | None = None,
    ) -> Rollout:
        """One rollout of this rank's prompts (G completions each), through `rollout_func` or the agent loop.

        Args:
            trainer: the `GRPOTrainer` (its engine and tokenization; what `rollout_func` receives). Its `args` give
                the sampling settings.
            prompt_ids: the templated prompts, one per row.
            context: the rollout's dataset rows, the step that seeds its sampling and G (`RolloutContext`).
            on_group: called with row i and its G completions' token ids as soon as all of them are complete (as
                `colograd.engine.core.Engine.generate`'s); not with a `rollout_func`, which returns them all at once.
        """
        args, g, rows = trainer.args, context.num_generations, context.rows
        prompts = [row["prompt"] for row in rows for _ in range(g)]
        if self.rollout_func is not None:
            return self._from_rollout_func(self.rollout_func(prompts, trainer), len(prompts))
        trajectory_prompts = [prompt_ids[i // g] for i in range(len(prompts))]
        tools = [self.tools] * len(prompts)
        columns = {}
        if self._factories:
            environments, trajectory_prompts, tools = self._reset(trainer, prompts, rows, trajectory_prompts, g)
            columns = {"environments": environments}
        rng = random.Random(hash((args.seed, args.process_index, context.step)))
        trajectories = [
            Trajectory(p, t, seed=rng.getrandbits(31)) for p, t in zip(trajectory_prompts, tools, strict=True)
        ]
        routing = trainer.engine.routing_capture() if args.routing_replay == "rollout" else None
        loop = AgentLoop(trainer.engine.requests(tap=True), self.tokenizer, self.parser, self.result_ids, self.runner,
                         args.max_completion_length, args.max_tool_calling_iterations, routing)  # fmt: skip
        params = turn_sampling_params(args, self.parser.stop)
        routed = loop.run(trajectories, params, _group_reporter(trajectories, g, on_group))
        calls, failures = sum(t.calls for t in trajectories), sum(t.failures for t in trajectories)
        metrics = {
            "tools/call_frequency": calls / len(trajectories),
            "tools/failure_frequency": failures / calls if calls else 0.0,
            "tools/turns/mean": sum(t.turns for t in trajectories) / len(trajectories),
            "tools/turns/max": max(t.turns for t in trajectories),
        }
        return Rollout(
            [t.ids for t in trajectories],
            [t.logps for t in trajectories],
            [t.truncated for t in trajectories],
            tool_mask=[t.tool_mask for t in trajectories],
            prompt_ids=[t.prompt_ids for t in trajectories] if self._factories else None,
            columns=columns,
            metrics=metrics,
            counts={"completions": len(trajectories), "calls": calls, "failures": failures},
            asked=[True] * len(trajectories),  # every turn reads its log-probs (a missed tap leaves NaN: counted)
            routed=routed,
        )

    def _reset(
        self, trainer: Any, prompts: list, rows: list[dict], prompt_ids: list[list[int]], g: int
    ) -> tuple[list[Any], list[list[int]], list[dict[str, Callable]]]:
        """Take one environment per completion from its pool (the one its row names, with several) and reset it
        with the row; a completion whose environment adds to the prompt, or shows other tools than the first
        rendering did, gets its prompt templated again (G completions per row). Returns the environments, prompts and
        tools of each one."""
        names = [self._environment_name(rows[i // g]) for i in range(len(prompts))]
        environments, taken = [], dict.fromkeys(self._pools, 0)
        for name in names:
            pool = self._pools[name]
            if taken[name] == len(pool):
                pool.append(self._factories[name]())
            environments.append(pool[taken[name]])
            taken[name] += 1
        observations = []
        for i, env in enumerate(environments):
            row = rows[i // g]
            observations.append(
                env.reset(**({k: v for k, v in row.items() if k != "environment"} if self._multi else row))
            )
        for name in self._pools:
            changed = [
                i for i, obs in enumerate(observations) if names[i] == name and (obs is not None or self._multi)
            ]
            if changed:
                extended = [{"prompt": _add_to_prompt(prompts[i], observations[i])} for i in changed]
                for i, ids in zip(changed, self._template(trainer, extended, self._env_schemas[name]), strict=True):
                    prompt_ids[i] = ids
        tools = [
            {**self.tools, **{tool: getattr(env, tool) for tool in self._env_tools[name]}}
            for env, name in zip(environments, names, strict=True)
        ]
        return environments, prompt_ids, tools

    def _environment_name(self, row: dict) -> str | None:
        name = row.get("environment") if self._multi else None
        if name not in self._factories:
            raise ValueError(
                f"Example has `environment={name!r}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(self._factories)}."
            )
        return name

    def _template(self, trainer: Any, rows: list[dict], schemas: list[dict]) -> list[list[int]]:
        """The trainer's tokenization of `rows`' prompts (`prepare_prompts`), rendered with these tool schemas and cut
        to the trainer's `prompt_limit` as every rollout's prompts are."""
        return [ids[-trainer.prompt_limit :] for ids in trainer.prepare_prompts(rows, tools=schemas)[1]]

    def _from_rollout_func(self, output: dict[str, list], expected: int) -> Rollout:
        missing = {"prompt_ids", "completion_ids", "logprobs"} - output.keys()
        if missing:
            raise ValueError(f"rollout_func must return the keys {sorted(missing)} in its output dict.")
        if len(output["completion_ids"]) != expected:
            raise ValueError(
                f"rollout_func returned {len(output['completion_ids'])} completions for {expected} prompts; it gets "
                "each prompt num_generations times and returns one completion per entry."
            )
        if output["logprobs"] is None:
            raise ValueError("rollout_func must return the engine's log-prob of every completion token in `logprobs`.")
        ends = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id}
        columns = {
            k: v for k, v in output.items() if k not in ("prompt_ids", "completion_ids", "logprobs", "env_mask")
        }
        return Rollout(
            [list(ids) for ids in output["completion_ids"]],
            [list(lp) for lp in output["logprobs"]],
            [not ids or ids[-1] not in ends for ids in output["completion_ids"]],  # no end-of-text: cut (TRL's rule)
            tool_mask=output.get("env_mask"),
            prompt_ids=[list(ids) for ids in output["prompt_ids"]],
            columns=columns,  # its extra keys reach the reward functions
            asked=[True] * len(output["completion_ids"]),  # it returns every token's log-prob: a NaN is its engine's
        )


class VLLMGeneration:
    """`trainer.vllm_generation`: the part of TRL's `trl.generation.VLLMGeneration` (colocate mode) that
    `rollout_func` code reaches for, backed by the trainer's own engine, so such code runs unchanged.

    `generate` samples once per prompt entry (the entries already repeat each prompt G times, as in TRL's colocate
    mode) with the run's sampling settings and returns TRL's tuple; `llm` is the `vllm.LLM` itself; `sync_weights`
    writes the current weights into it (the engine already holds them when a `rollout_func` runs).
    """

    mode = "colocate"

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self.structured_outputs_regex = trainer.args.vllm_structured_outputs_regex
        self.tensor_parallel_size = trainer.args.vllm_tensor_parallel_size

    @property
    def llm(self) -> Any:
        """The engine's `vllm.LLM`, holding the current weights: reached outside a rollout after one, a CPU engine
        that released its packed weights is synced first."""
        return self._requests().llm

    def sync_weights(self) -> None:
        """Write the current weights into the engine (`Engine.sync`: an engine asleep between rollouts, with sleep
        mode on, is woken for the write and put back to sleep, as a rollout does)."""
        self._trainer.sync_weights()

    def _requests(self, tap: bool = False) -> Any:
        return self._trainer.engine.requests(resync=self._trainer.sync_weights, tap=tap)

    def generate(
        self, prompts: list[list[int]], images: list | None, num_generations: int, profiler: Any = None
    ) -> tuple[list[list[int]], list[list[int]], list[list[list[float]]], list[list[list[int]]]]:
        """One completion per entry of `prompts` (token ids), as TRL's colocate mode does (`num_generations` is
        only read by TRL's server mode).

        Returns:
            prompt_ids [N][P], completion_ids [N][T], logprobs [N][T][1] (the sampled token's log-prob) and
            logprob_token_ids [N][T][1] (the sampled token), TRL's shapes with `logprobs=0`.
        """
        if images is not None and any(i is not None for i in images):
            raise ValueError("vllm_generation.generate: images are not supported; pass images=None.")
        if self.tensor_parallel_size > 1:  # the ranks of one engine would have to pass the same prompts
            raise ValueError("vllm_generation.generate does not support vllm_tensor_parallel_size > 1; set it to 1.")
        engine, requests = self._trainer.engine, self._requests(tap=True)
        tap = requests.tap  # the log-probs as tensors from the sampler: vLLM builds no per-token objects
        with profiler or nullcontext(), tap.capturing() if tap is not None else nullcontext():
            outputs = requests.generate(
                [engine.prompt(list(ids)) for ids in prompts], sampling_params(self._trainer.args, n=1)
            )
        samples = [request.outputs[0] for request in outputs]
        if tap is None:
            logps = [[pos[t].logprob for pos, t in zip(s.logprobs, s.token_ids, strict=True)] for s in samples]
        elif (logps := tap.logps(outputs)) is None:
            # The tap's rows missed a completion (and vLLM built no objects): sample again with the objects, and
            # leave the tap off from now on, as `Engine.generate` does.
            logger.warning("colograd: the sampler tap missed vllm_generation's log-probs; reading vLLM's objects.")
            tap.uninstall()
            return self.generate(prompts, images, num_generations, profiler)
        return (
            [list(request.prompt_token_ids) for request in outputs],
            [list(s.token_ids) for s in samples],
            [[[logp] for logp in row] for row in logps],
            [[[t] for t in s.token_ids] for s in samples],
        )


def _environment_tools(env: Any) -> list[str]:
    """The names of an environment's tools: its public methods besides `reset` and `get_reward`."""
    if not callable(getattr(env, "reset", None)):
        raise ConfigError(f"environment_factory: {type(env).__name__} has no `reset` method; environments need one.")
    # Listed on the class: listing the instance would evaluate its properties.
    members = inspect.getmembers(type(env), predicate=inspect.isfunction)
    return [name for name, _ in members if not name.startswith("_") and name not in ("reset", "get_reward")]


def _environment_reward(env_type: type) -> Callable[..., list[float | None]]:
    """A reward function that asks each completion's environment of exactly this class for its reward (`get_reward()`,
    sync or async); other environments' completions get None (no reward from it), as in TRL."""
    if inspect.iscoroutinefunction(env_type.get_reward):

        async def reward(environments: list, **kwargs: Any) -> list[float | None]:
            return [await env.get_reward() if type(env) is env_type else None for env in environments]
    else:

        def reward(environments: list, **kwargs: Any) -> list[float | None]:
            return [env.get_reward() if type(env) is env_type else None for env in environments]

    reward.__name__ = env_type.__name__
    return reward


def _add_to_prompt(prompt: Any, observation: str | None) -> Any:
    """The prompt with an environment's first observation (if any) added to its last message (or to its text)."""
    if observation is None:
        return prompt
    if isinstance(prompt, str):
        return prompt + observation
    return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]
