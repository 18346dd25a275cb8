"""The colocated vLLM engine: its memory, context, batching, dtype and parallelism, and how weights reach it (TRL's
names and meanings where TRL has the field)."""

from dataclasses import dataclass, field

from colograd.errors import ConfigError


@dataclass
class EngineOptions:
    """The engine each training process (or tensor-parallel group) runs, and the weight sync into it."""

    vllm_gpu_memory_utilization: float | None = field(
        default=None,
        metadata={
            "help": "Fraction of GPU memory the engine may take (weights + KV cache; vLLM fills it with KV cache). "
            "None: the KV cache is sized to the rollout instead (vllm_max_num_seqs sequences of a prompt and a "
            "completion, with margin), leaving the rest to training. GPU only."
        },
    )
    vllm_kv_cache_gib: float | None = field(
        default=None,
        metadata={
            "help": "KV-cache size in GiB of each engine. None: sized to the rollout (vllm_max_num_seqs sequences of "
            "a prompt and a completion, with margin; a prompt is max_prompt_length, else the longest of 256 sampled "
            "from the dataset; at most 0.3 of a GPU, or 1 GiB of a machine without one)."
        },
    )
    vllm_dtype: str | None = field(
        default=None,
        metadata={
            "help": "The engine's dtype when it should differ from the trainer's compute dtype: 'bfloat16' or "
            "'float16' (e.g. an fp32 trainer with an adapter-only LoRA sync on a GPU, whose LoRA kernels take "
            "16-bit only). The engine then samples from a rounded policy, so the importance-sampling correction is "
            "turned on and old log-probs come from the trainer. None: the trainer's (exact parity)."
        },
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={
            "help": "Engine context length. None: max_prompt_length + max_completion_length, or without "
            "max_prompt_length the model's own context (max_position_embeddings)."
        },
    )
    vllm_enforce_eager: bool = field(
        default=False, metadata={"help": "Disable CUDA graphs / compilation in the engine (faster start-up)."}
    )
    vllm_enable_prefix_caching: bool = field(
        default=True,
        metadata={
            "help": "Let the engine reuse the KV cache of shared prompt prefixes. Set aside on a CPU engine whose "
            "model has Mamba-2 layers (vLLM's CPU build cannot keep their mid-prompt states; said at start-up)."
        },
    )
    vllm_max_num_seqs: int | None = field(
        default=None,
        metadata={
            "help": "Most sequences the engine decodes at once. None: a whole rollout of this rank's TP group "
            "(prompts × num_generations), so one rollout runs as one batch."
        },
    )
    vllm_max_num_batched_tokens: int | None = field(
        default=None,
        metadata={"help": "Most tokens per engine forward pass (bounds chunked prefill). None: vLLM's default."},
    )
    vllm_tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Split each engine over this many consecutive ranks (tensor parallel). The ranks of a group "
            "pool their prompts, generate together and each keep their own completions. Must divide the number "
            "of processes."
        },
    )
    vllm_cpu_repack_weights: bool = field(
        default=True,
        metadata={
            "help": "Without a GPU: let vLLM repack linear weights for oneDNN (its default: faster generation). Off, "
            "the engine computes with plain weights that a sync copies into directly: a faster sync, a slower "
            "rollout (figures in docs/weight-sync.md)."
        },
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={"help": "Release the engine's GPU memory (KV cache, weights) during the update. GPU only."},
    )
    sync_bucket_mib: float = field(
        default=512,
        metadata={
            "help": "With sharded weights (ZeRO-3, FSDP2) or a merged LoRA, gather or build and sync them in buckets "
            "of about this many MiB."
        },
    )
    engine_parity: str = field(
        default="error",
        metadata={
            "help": "What the parity guard does when the engine's log-probs of its own samples are past the tolerance "
            "of the run's precision from the trainer's (the engine is then sampling from another model): 'error' "
            "stops the run, before its first optimizer step when the first rollout after a start or resume shows it, "
            "with a checkpoint when later rollouts keep showing it; 'warn' warns and trains on (the gap is logged as "
            "parity/*). See docs/real-models.md."
        },
    )
    lora_sync: str = field(
        default="merged",
        metadata={
            "help": "How a PEFT LoRA model reaches the engine: 'merged' (base + B·A written into its weights) or "
            "'adapter' (only the adapter tensors move; the engine applies them with vLLM's LoRA support)."
        },
    )

    def check_engine(self) -> None:
        """The engine's dtype, weight sync and parallelism; a differing engine dtype turns the sampling correction
        on."""
        if self.engine_parity not in ("error", "warn"):
            raise ConfigError(f"engine_parity={self.engine_parity!r} is unknown; use 'error' or 'warn'.")
        if self.lora_sync not in ("merged", "adapter"):
            raise ConfigError(f"lora_sync={self.lora_sync!r} is unknown; use 'merged' or 'adapter'.")
        if self.world_size % self.vllm_tensor_parallel_size:
            raise ConfigError(
                f"vllm_tensor_parallel_size={self.vllm_tensor_parallel_size} does not divide the {self.world_size} "
                "processes; set it to a divisor of the number of processes (1 gives every rank its own engine)."
            )
        if self.vllm_dtype not in (None, "bfloat16", "float16"):
            raise ConfigError(f"vllm_dtype={self.vllm_dtype!r} is unknown; use 'bfloat16', 'float16' or None.")
        if self.engine_dtype_differs:
            # π_engine differs from π_trainer by the rounding of every layer: correct for it, as TRL does for an
            # engine that does not compute exactly what the trainer does.
            self.vllm_importance_sampling_correction = True

    @property
    def engine_dtype_differs(self) -> bool:
        """Whether `vllm_dtype` makes the engine compute in another dtype than the trainer's mixed precision."""
        trainer = {"bf16": "bfloat16", "fp16": "float16"}.get(self.mixed_precision)
        return self.vllm_dtype is not None and self.vllm_dtype != trainer
