"""Train a model family the zoo never names, as a user would arrive with it: one line saying how it ended.

    python tests/scripts/family_sweep.py MODEL_TYPE          # one family, e.g. ernie4_5_moe
    python tests/scripts/family_sweep.py --list              # the model types to sweep, one per line
    for t in $(python tests/scripts/family_sweep.py --list); do python tests/scripts/family_sweep.py $t; done

The config is transformers' default for MODEL_TYPE (for most families their flagship's published values) as a zoo
entry (`zoo.from_defaults`); the model is the zoo's stopping model of it (`zoo.shrunk`, sharp weights), trained two
steps in this process with TRL's quickstart settings, 64-token completions and the parity gate on. The last line
printed is `SWEEP {json}`: `outcome` is `trained` (with `gap`, the largest sampling gap of the last step), `refused`
(a ConfigError), `gate` (the gate's stop), `unbuilt` (the sweep could not make the model: its own shrinking, not
colograd) or `traceback` (anything else, with `tb`). docs/real-models.md ("Families the tests never name") has a
run's results. Not part of the suite: a family takes ~25 s, the list ~25 min.
"""

import json
import sys
import tempfile
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "zoo")]

import zoo  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402


def unnamed_types() -> list[str]:
    """Model types transformers and vLLM both have as causal LMs (vLLM's own model, not its Transformers backend)
    that no zoo entry is."""
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    named = {entry["model_type"] for table in (zoo.ZOO, zoo.PARITY, zoo.HYBRIDS) for entry in table.values()}
    both = [t for t, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if cls in _TEXT_GENERATION_MODELS]
    return sorted(set(both) - named)


def sweep(model_type: str) -> dict:
    out: dict = {"model_type": model_type}
    try:
        name = zoo.from_defaults(model_type)
        config = zoo.shrunk(name)
        out |= {"layers": config.num_hidden_layers, "hidden": config.hidden_size}
        model, tokenizer = zoo.stopping_model(name)
    except Exception as err:
        return out | {"outcome": "unbuilt", "error": f"{type(err).__name__}: {err}"[:300]}

    from datasets import Dataset
    from test_zoo import answer_length, chat_rows, step_log

    from colograd import GRPOConfig, GRPOTrainer
    from colograd.errors import ConfigError
    from colograd.grpo.parity import ParityError

    with tempfile.TemporaryDirectory() as folder:
        args = GRPOConfig(output_dir=folder, max_steps=2, report_to="none", save_strategy="no",
                          vllm_enforce_eager=True, max_completion_length=64)  # fmt: skip
        try:
            rows = Dataset.from_list(chat_rows() * 4)
            trainer = GRPOTrainer(
                model=model, reward_funcs=answer_length, args=args, train_dataset=rows, processing_class=tokenizer
            )
            trainer.train()
            gap = step_log(trainer).get("sampling/sampling_logp_difference/max")
            return out | {"outcome": "trained", "gap": gap, "steps": trainer.state.global_step}
        except ParityError as err:
            return out | {"outcome": "gate", "error": str(err)}
        except ConfigError as err:
            return out | {"outcome": "refused", "error": str(err)}
        except Exception as err:
            return out | {"outcome": "traceback", "error": f"{type(err).__name__}: {err}"[:600],
                          "tb": traceback.format_exc()[-3000:]}  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:] == ["--list"]:
        print("\n".join(unnamed_types()))
    elif len(sys.argv) == 2:
        print("\nSWEEP " + json.dumps(sweep(sys.argv[1])), flush=True)
    else:
        sys.exit(__doc__)
