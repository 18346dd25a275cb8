"""Every check that runs before the engine starts: the recipe, data, model, environment and engine fit."""

from colograd.moved import forward

__getattr__ = forward(__name__)  # `from colograd.preflight import X` as before the move: X from `core`
