"""The error a user fixes: `ConfigError` (the CLI prints its one line and exits with code 2)."""

import json
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
