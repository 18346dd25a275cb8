"""A rollout's orchestration: what a rollout call returns and the metrics recorded from it (`core`), DAPO's dynamic
sampling, APRIL's partial rollouts, and evaluation during training."""
