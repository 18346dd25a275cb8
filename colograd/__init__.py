"""colograd: GRPO with a vLLM engine inside every training process."""

from colograd import moved
from colograd.config.core import GRPOConfig, ScriptArguments
from colograd.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "ScriptArguments"]
__version__ = "0.1.0"

moved.install()  # old module names (`colograd.models.tiny`) import their moved modules
