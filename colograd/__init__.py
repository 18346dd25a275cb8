"""colograd: GRPO with a vLLM engine inside every training process."""

# First: bounds the CPU kernels' per-shape caches before anything builds a kernel (see the module).
import colograd.runs.kernel_caches  # noqa: F401
from colograd.config.core import GRPOConfig, ScriptArguments
from colograd.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "ScriptArguments"]
__version__ = "0.1.0"
