"""Multi-turn rollouts: the tool-calling loop and its tool-call parsers."""

from colograd.moved import forward

__getattr__ = forward(__name__)  # `from colograd.agents import X` as before the move: X from `core`
