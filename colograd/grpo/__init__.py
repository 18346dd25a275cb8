"""The GRPO step's math: log-probs, packing and attention segments, the loss, entropy, batching, the reference
policy and rollout metrics."""
