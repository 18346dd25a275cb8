"""The trainer's forward pass: a rollout slice as tensors (`batch`), its completion log-probs, packed or padded, with
shared prompts and attention segments (`logps`, `packing`, `attention`), the pass's token budget (`memory`), and an
MoE router's loss and routing replay (`router`); `core.Forward` decides how a run forwards, once."""
