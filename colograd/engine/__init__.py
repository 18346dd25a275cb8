"""The vLLM engine inside each training process: launch, lifetime, requests, KV sizing, LoRA and MoE on the
engine side, and the weight sync from the trainer."""
