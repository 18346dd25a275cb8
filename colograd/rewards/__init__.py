"""Rewards: resolving and scoring reward functions, early scoring, and code rewards run in a sandbox."""

from colograd.moved import forward

__getattr__ = forward(__name__)  # `from colograd.rewards import X` as before the move: X from `core`
