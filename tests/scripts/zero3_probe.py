"""The start-up probe of a hybrid's packed passes on weights ZeRO-3 has partitioned, in one process (a world of one
over gloo): tests/forward/test_stateful_layers.py runs it. Prints one JSON line: whether the packed layout was found to
keep sequences apart (`packed_apart`), whether the plain packed forward was found to leak (the probe computed with the
real weights), and whether every weight is partitioned again after."""

import json
import os
import sys
import tempfile

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import zoo  # noqa: E402  (tests/zoo.py)

from colograd.forward.core import packed_apart  # noqa: E402
from colograd.forward.packing import keeps_packed_sequences_apart  # noqa: E402


def main() -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=0, world_size=1)
    config = zoo.shrunk(sys.argv[1])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    zoo.sharpen(model)
    deepspeed.zero.Init(
        module=model, config_dict_or_path={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
    )
    partitioned = all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
    apart = packed_apart([model], model)
    record = {
        "partitioned": partitioned,
        "apart": apart is not None,
        "layers": len(apart.layers) if apart is not None else 0,
        "plain_packing_leaks": not keeps_packed_sequences_apart(model),
        "partitioned_after": all(p.numel() == 0 for p in model.parameters()),
    }
    print(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
