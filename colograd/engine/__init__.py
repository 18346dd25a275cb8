"""The vLLM engine inside each training process: launch, lifetime, requests, KV sizing, LoRA and MoE on the
engine side, and the weight sync from the trainer."""

from colograd.moved import forward

__getattr__ = forward(__name__)  # `from colograd.engine import X` as before the move: X from `core`
