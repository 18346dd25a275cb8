"""Tools for agentic rollouts: how a turn's tool calls are found in the model's text, how tools run (each sync call
on a thread of its own, async ones on an event loop, each with a timeout), and which tokens a tool's result is
inserted as.

A tool is a plain Python function (or coroutine function) with type hints and a Google-style docstring, as TRL and
transformers' chat templates expect: its JSON schema is read from them (`transformers.utils.get_json_schema`).
"""

import asyncio
import inspect
import json
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase


@dataclass
class ToolCall:
    """One call the model asked for. `error` is set when the call could not be read (the model sees it)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


class ToolCallParser(Protocol):
    """Finds tool calls in the text of one model turn.

    A turn ends where the model ends it (its end-of-turn token) or at one of the parser's `stop` strings, which the
    engine keeps in the output; then its tools run while other requests decode. `parse` returns the turn's calls;
    none means a final answer.
    """

    stop: list[str]

    def parse(self, text: str) -> list[ToolCall]: ...


class HermesToolParser:
    """The format of the Qwen2.5, Qwen3 and Hermes chat templates (and TRL's response schema for them):

    <tool_call>
    {"name": "multiply", "arguments": {"a": 3, "b": 4}}
    </tool_call>

    A turn may hold several calls; it ends with the template's end-of-turn token, after which the template inserts
    the results, so no stop string is needed.
    """

    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def __init__(self) -> None:
        self.stop: list[str] = []

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for body in self._CALL.findall(text):
            try:
                call = json.loads(body)
                calls.append(ToolCall(str(call["name"]), dict(call.get("arguments") or {})))
            except (ValueError, KeyError, TypeError) as e:
                calls.append(ToolCall("", {}, error=f"unreadable tool call {body.strip()!r}: {e}"))
        return calls


class MarkerToolParser:
    """A one-tool format for models that know no chat template: a turn that ends with `marker` calls `tool`, with
    the turn's text before the marker as the argument named `argument`. E.g. ``MarkerToolParser("=", "calc",
    "expression")`` reads the turn ``"12+30="`` as ``calc(expression="12+30")``; the result is inserted after the
    ``=`` and the model goes on. The tests use it with the tiny character-level models.
    """

    def __init__(self, marker: str, tool: str, argument: str) -> None:
        self.stop = [marker]
        self.tool, self.argument = tool, argument

    def parse(self, text: str) -> list[ToolCall]:
        marker = self.stop[0]
        if not text.endswith(marker):
            return []
        return [ToolCall(self.tool, {self.argument: text[: -len(marker)]})]


@dataclass
class ToolResult:
    """A finished call: `content` is what the model reads (an error message when `failed`)."""

    name: str
    content: Any
    failed: bool


class PendingCalls:
    """The calls of one turn, running. Each has a deadline; a call past it counts as failed (timed out)."""

    def __init__(self, calls: list[ToolCall], futures: list[Future | None], errors: list[str | None], timeout: float):
        self.calls, self.futures, self.errors = calls, futures, errors
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout

    def ready(self) -> bool:
        """Whether every call has returned, raised, or run out of time."""
        return time.monotonic() >= self.deadline or all(f is None or f.done() for f in self.futures)

    def results(self) -> list[ToolResult]:
        """The results, in call order (call only when `ready`). A failure's content is TRL's ``{"error": ...}``."""
        out = []
        for call, future, error in zip(self.calls, self.futures, self.errors, strict=True):
            if error is None and not future.done():
                future.cancel()  # a thread cannot be stopped; its result, if it comes, is ignored
                error = f"tool {call.name!r} timed out after {self.timeout:g} s"
            elif error is None and future.exception() is not None:
                error = f"{type(future.exception()).__name__}: {future.exception()}"
            if error is None:
                result = future.result()
                out.append(ToolResult(call.name, result if isinstance(result, list) else str(result), False))
            else:
                out.append(ToolResult(call.name, str({"error": error}), True))
        return out


class ToolRunner:
    """Runs tool calls off the decoding thread: each sync call on a daemon thread of its own, async ones on one event
    loop in a daemon thread. Nothing a tool does (raise, hang) reaches the caller except as a failed result.

    A thread per call rather than a pool: Python cannot stop a thread, so a sync tool that hangs past its timeout
    keeps its thread (and what it holds) until it returns. In a pool, enough hung calls would take every worker and
    the next calls would wait behind them forever, and the pool's workers are joined at exit, so the process could
    not end; a daemon thread of its own blocks neither. A hung async tool is cancelled at its timeout (a coroutine
    that blocks its event loop without awaiting stalls the other async tools, as on any event loop).

    Args:
        timeout: seconds each turn's calls may take, together; the model then reads a timeout error.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    def submit(self, tools: dict[str, Callable], calls: list[ToolCall]) -> PendingCalls:
        """Start every call of one turn now; they run concurrently."""
        futures: list[Future | None] = []
        errors: list[str | None] = []
        for call in calls:
            func = tools.get(call.name)
            error = call.error or (None if func else f"tool {call.name!r} not found; tools: {', '.join(tools)}")
            future = None
            if error is None:
                if inspect.iscoroutinefunction(func):
                    future = asyncio.run_coroutine_threadsafe(_call_async(func, call.arguments), self._event_loop())
                else:
                    future = _start_thread(func, call.arguments)
            futures.append(future)
            errors.append(error)
        return PendingCalls(calls, futures, errors, self.timeout)

    def close(self) -> None:
        """Stop the async tools' event loop; running calls are not waited for."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="colograd-tools-async", daemon=True).start()
        return self._loop


def _start_thread(func: Callable, arguments: dict[str, Any]) -> Future:
    """`func(**arguments)` on a new daemon thread; its outcome lands in the returned future."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = func(**arguments)
        except BaseException as e:  # whatever the tool raises becomes its failed result
            future.set_exception(e)
        else:
            future.set_result(result)

    threading.Thread(target=run, name=f"colograd-tool-{getattr(func, '__name__', 'call')}", daemon=True).start()
    return future


async def _call_async(func: Callable, arguments: dict[str, Any]) -> Any:
    return await func(**arguments)


def tool_messages(results: list[ToolResult]) -> list[dict[str, Any]]:
    """The chat messages of a turn's results, as TRL builds them."""
    return [{"role": "tool", "name": r.name, "content": r.content} for r in results]


def chat_template_result_ids(
    tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: dict | None = None
) -> Callable[[list[dict]], list[int]]:
    """The tokens the chat template inserts for a turn's tool messages, up to and including the prompt of the next
    assistant turn: rendered once after a short conversation and once without the tool messages, and told apart
    by the difference (as TRL's `_get_tool_suffix_ids` does). Earlier turns are never re-tokenized.

    Returns:
        a function from a turn's tool messages to their token ids.
    """
    kwargs = chat_template_kwargs or {}

    def result_ids(messages: list[dict]) -> list[int]:
        call = [{"type": "function", "function": {"name": messages[0]["name"], "arguments": {}}}]
        head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
        prefix = tokenizer.apply_chat_template(head, tokenize=True, return_dict=False, **kwargs)
        full = tokenizer.apply_chat_template(
            head + messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )
        # Templates close the assistant turn with EOS and then a newline: cut after the EOS, as the model stops there.
        eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
        prefix = prefix[: eos[-1] + 1] if eos else prefix
        if full[: len(prefix)] != prefix:
            raise ValueError("the chat template does not render a tool conversation as an extension of its start")
        return full[len(prefix) :]

    return result_ids


def plain_result_ids(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[dict]], list[int]]:
    """For prompts without a chat template: a turn's results are inserted as their text, one per line."""

    def result_ids(messages: list[dict]) -> list[int]:
        text = "\n".join(str(m["content"]) for m in messages)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return result_ids
