"""A run's life on disk and in time: checkpoints, saving, the output folder, preemption, time limits,
per-phase timing, the completion log and the model card."""
