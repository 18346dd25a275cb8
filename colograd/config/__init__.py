"""What a run is told: `GRPOConfig` and its topic groups, their ranges, the recipe parser, and TRL's names."""

from colograd.moved import forward

__getattr__ = forward(__name__)  # `from colograd.config import X` as before the move: X from `core`
