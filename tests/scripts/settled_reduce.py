"""All-reduces on 2 processes over gloo, through `colograd.runs.ranks.all_reduce_settled` and through plain
`torch.distributed.all_reduce`: how many holders each tensor has when the call returns. Run under a multi-process
launch:

    accelerate launch --config_file recipes/accelerate_configs/cpu.yaml tests/scripts/settled_reduce.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.json: for each way, the tensors' holder counts on return (1: the caller alone) and
whether every sum was right.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from colograd.runs.ranks import all_reduce_settled

CALLS = 300


def main() -> None:
    dist.init_process_group("gloo")
    record = {}
    for way, reduce in (("settled", all_reduce_settled), ("plain", dist.all_reduce)):
        holders, right = [], True
        for i in range(CALLS):
            tensor = torch.full((9,), float(i))  # the run summary's size
            reduce(tensor)
            holders.append(tensor._use_count())
            right &= bool((tensor == 2 * i).all())
        record[way] = {"holders": holders, "right": right}
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
