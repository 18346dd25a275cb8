"""The long-tail features on 2 ranks under ZeRO-3, in one launch (tests/rollout/test_dynamic_sampling.py,
tests/rollout/test_partial_rollouts.py): dynamic sampling's run (`dynamic_check.py`), then partial rollouts'
(`partial_check.py`), one trainer after the other in the same processes, so that the launch's start-up is paid once.

    accelerate launch --config_file tests/configs/zero3_cpu.yaml tests/scripts/longtail_check.py OUT_DIR

Each writes its ranks' records under OUT_DIR/dynamic and OUT_DIR/partial.
"""

import os
import sys

import dynamic_check
import partial_check

if __name__ == "__main__":
    out = sys.argv[1]
    for name, check in (("dynamic", dynamic_check), ("partial", partial_check)):
        os.makedirs(os.path.join(out, name), exist_ok=True)
        check.run(os.path.join(out, name))
