"""The error a user fixes: `ConfigError` (the CLI prints its one line and exits with code 2); and how an error from a
library's code is said in one line (`said`), naming where in the library it was raised."""

import json
import sys
import traceback
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration problem the user must fix; its message names the field and the fix."""


class SaidBefore(ConfigError):
    """A `ConfigError` an earlier attempt of the same launch already said (torchrun's restarts repeat a refused
    start): the CLI exits with code 2 without saying it again."""


def keyword_arguments(name: str, value: Any) -> dict[str, Any] | None:
    """A config field holding keyword arguments: a mapping (from a recipe), JSON text (from a flag), or None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"{name}={value!r} is not a JSON object ({err}); write it as '{{\"key\": 1}}'."
            ) from None
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"{name}={value!r}: give a mapping of keyword arguments.")
    return value


def said(err: BaseException, library: str = "vllm") -> str:
    """`err` in one line: its type and first line, and, raised in `library`'s own code, where: the file and line
    that raised it (with the line's source when the message is empty, as a bare `assert` leaves it) and the model
    code that called it, so that a failure in the engine's code reads as the engine's, not as colograd's."""
    text = (str(err).strip().splitlines() or [""])[0]
    line = f"{type(err).__name__}: {text}" if text else type(err).__name__
    frames = library_frames(err, library)
    if not frames:
        return line
    root = _package_root(library).parent

    def at(frame: traceback.FrameSummary) -> str:
        return f"{Path(frame.filename).resolve().relative_to(root)}:{frame.lineno}"

    raised = frames[0]
    where = at(raised) + (f": `{raised.line.strip()}`" if not text and raised.line else "")
    model = next((f for f in frames if "model_executor" in Path(f.filename).parts), None)
    if model is not None and model is not raised:
        where += f", called from {at(model)}"
    return f"{line} ({where})"


def library_frames(err: BaseException, library: str) -> list[traceback.FrameSummary]:
    """The frames of `library`'s own code that `err` was raised through, innermost first, up to the first frame of
    colograd's: empty when `library` is not imported or colograd's code is deeper than all of them (a callback
    colograd gave the library raised it). The library may raise through another's code (vLLM's models read their
    config through transformers'): those frames are passed over."""
    if (root := _package_root(library)) is None:
        return []
    own = Path(__file__).resolve().parent
    frames = []
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(own):
            break
        if path.is_relative_to(root):
            frames.append(frame)
    return frames


def _package_root(name: str) -> Path | None:
    module = sys.modules.get(name)
    return Path(module.__file__).resolve().parent if module is not None and module.__file__ else None
