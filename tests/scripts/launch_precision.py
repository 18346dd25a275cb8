"""Start a GRPOTrainer under a launch config with `mixed_precision: bf16`, and record what it chose:

    accelerate launch --config_file tests/configs/cpu_bf16.yaml tests/scripts/launch_precision.py OUT_DIR

The decoder layers are bf16 and the embeddings float32: the trainer must warn (bf16 trainable weights under
DDP, no master copy), and the engine must run in bf16 because the launch config says so, not because of the
first parameter's dtype. Each rank writes OUT_DIR/rank<r>.json.
"""

import json
import os
import sys

import torch.distributed as dist

from colograd import GRPOTrainer
from colograd.models import tiny


def main() -> None:
    out = sys.argv[1]
    model = tiny.build_model()
    model.model.layers.bfloat16()
    trainer = GRPOTrainer(
        model,
        "letters",
        tiny.run_config(os.path.join(out, "run"), 1),
        tiny.letters_dataset(64),
        processing_class=tiny.build_tokenizer(),
    )
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(
            {
                "mixed_precision": trainer.accelerator.mixed_precision,
                "first_param_dtype": str(next(model.parameters()).dtype),
                "engine_dtype": str(trainer.engine.llm.llm_engine.model_config.dtype),
            },
            f,
        )


if __name__ == "__main__":
    main()
