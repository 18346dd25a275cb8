"""colograd: GRPO with a vLLM engine inside every training process."""

from colograd.config.core import GRPOConfig, ScriptArguments
from colograd.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "ScriptArguments"]
__version__ = "0.1.0"
