"""Agentic rollouts on the colocated engine, scheduled per request.

Every trajectory (one per completion: B prompts × G samples) is its own engine request. When one stops at a tool
call, its tools start (`colograd.tools.ToolRunner`) while the engine keeps decoding the others; when its results
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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from colograd.tools import ToolCall, ToolCallParser, ToolResult, ToolRunner, tool_messages


@dataclass
class Trajectory:
    """One completion being built, turn by turn.

    prompt_ids: the prompt's token ids. tools: the tools this trajectory may call, by name.
    seed: the sampling seed of its first turn (later turns derive theirs from it); None: the engine's generator.
    ids, logps, tool_mask: the completion so far, the engine's log-prob of each token (0.0 on inserted ones), and
    1 / 0 for sampled / inserted tokens. turns: model turns; calls, failures: tool calls made and failed.
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


class AgentLoop:
    """Drives a vLLM engine request by request (add requests, step, collect finished ones) and runs tools as
    trajectories ask for them.

    Args:
        llm: the `vllm.LLM` (its in-process `llm_engine` is stepped directly).
        tokenizer: decodes a turn's tokens for the parser.
        parser: finds tool calls in a turn's text; its `stop` strings end a turn that calls tools.
        result_ids: the tokens a turn's tool messages are inserted as (`colograd.tools.chat_template_result_ids`).
        runner: runs the tools.
        max_completion_length: bound of a whole completion, sampled and inserted tokens.
        max_tool_calling_iterations: turns that may call tools per trajectory; None: unbounded (TRL's meaning).
        lora_request: the adapter every request is served with, if any.
    """

    def __init__(
        self,
        llm: Any,
        tokenizer: PreTrainedTokenizerBase,
        parser: ToolCallParser,
        result_ids: Callable[[list[dict]], list[int]],
        runner: ToolRunner,
        max_completion_length: int,
        max_tool_calling_iterations: int | None = None,
        lora_request: Any = None,
    ) -> None:
        self.llm, self.tokenizer, self.parser, self.result_ids, self.runner = (
            llm,
            tokenizer,
            parser,
            result_ids,
            runner,
        )
        self.max_completion_length = max_completion_length
        self.max_tool_calling_iterations = max_tool_calling_iterations
        self.lora_request = lora_request

    def run(self, trajectories: list[Trajectory], params: Any) -> None:
        """Complete every trajectory in place. `params`: the `SamplingParams` of a turn (n=1); each request gets a
        copy with its own seed and the length left to its trajectory."""
        engine = self.llm.llm_engine
        waiting: dict[int, Any] = {}  # trajectory index -> its running tool calls
        for i, trajectory in enumerate(trajectories):
            self._add(engine, i, trajectory, params)
        while engine.has_unfinished_requests() or waiting:
            if engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        i = int(output.request_id.split(".")[0])
                        calls = self.end_turn(trajectories[i], output.outputs[0])
                        if calls:
                            waiting[i] = self.runner.submit(trajectories[i].tools, calls)
            else:  # every live trajectory is waiting for a tool: sleep until one returns or times out
                _wait_for_any(waiting.values())
            for i in [i for i, pending in waiting.items() if pending.ready()]:
                if self.insert_results(trajectories[i], waiting.pop(i).results()):
                    self._add(engine, i, trajectories[i], params)

    def _add(self, engine: Any, i: int, trajectory: Trajectory, params: Any) -> None:
        engine.add_request(
            f"{i}.{trajectory.turns}",
            {"prompt_token_ids": trajectory.prompt_ids + trajectory.ids},
            turn_params(params, trajectory, self.max_completion_length),
            lora_request=self.lora_request,
        )

    def end_turn(self, trajectory: Trajectory, sample: Any) -> list[ToolCall]:
        """Add a finished request's tokens to its trajectory. Returns the tool calls to run before the next turn;
        none when the trajectory is complete."""
        ids = list(sample.token_ids)
        trajectory.add_sampled(ids, [pos[tok].logprob for pos, tok in zip(sample.logprobs, ids, strict=True)])
        if sample.finish_reason == "length":
            trajectory.truncated = True
            return []
        if sample.stop_reason not in self.parser.stop:  # EOS or a stop of the user's: the answer is final
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
    """The `SamplingParams` of one turn from the run's config: one sample, the engine's log-prob of each sampled
    token, stopping (the stop string kept) where the parser says a tool call ends, output only when finished."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        max_tokens=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k if args.top_k > 0 else -1,
        repetition_penalty=args.repetition_penalty,
        logprobs=0,
        stop=stop,
        include_stop_str_in_output=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def _wait_for_any(waiting: Any) -> None:
    futures = [f for pending in waiting for f in pending.futures if f is not None and not f.done()]
    timeout = max(0.0, min(p.deadline for p in waiting) - time.monotonic())
    if futures:
        concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
