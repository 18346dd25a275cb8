"""The model card: Hub metadata, the recipe it cites, the metrics it reports; built offline."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers.trainer
from huggingface_hub import ModelCard

from colograd import GRPOConfig, GRPOTrainer
from colograd.models import tiny
from colograd.runs.modelcard import Recipe, model_card, write_model_card

HISTORY = [
    {"loss": 0.5, "reward": 0.25, "rewards/letters_reward/mean": 0.25, "step": 1},
    {"loss": -0.125, "reward": 0.875, "reward_std": 0.0625, "rewards/letters_reward/mean": 0.875, "step": 2},
    {"train_runtime": 3.0, "train_loss": 0.19, "step": 2},
]


def test_recipe_in_the_repository_is_named_by_its_repository_path(root, monkeypatch):
    monkeypatch.chdir(root / "recipes")  # however the path was spelled on the command line
    recipe = Recipe.from_argv(["--config", "grpo_tiny.yaml", "--max_steps", "2"], "colograd:tiny-qwen2", None)
    assert recipe.path == "recipes/grpo_tiny.yaml"
    assert recipe.text == (root / "recipes/grpo_tiny.yaml").read_text()
    assert recipe.overrides == ["--max_steps", "2"]
    assert Recipe.from_argv(["--config=grpo_tiny.yaml"], None, None).path == "recipes/grpo_tiny.yaml"
    assert Recipe.from_argv(["--max_steps", "2"], None, None) is None


def test_card_metadata_recipe_and_final_metrics(root, tmp_path):
    recipe = Recipe.from_argv(
        ["--config", str(root / "recipes/grpo_qwen.yaml"), "--max_steps", "2"],
        "Qwen/Qwen2.5-1.5B-Instruct",
        "trl-lib/DeepMath-103K",
    )
    card = model_card("my-model", recipe.model_name_or_path, recipe, HISTORY, world_size=8, tags=["math"])
    loaded = ModelCard.load(write_model_card(card, str(tmp_path)))
    assert loaded.data.tags == ["colograd", "grpo", "math"]
    assert loaded.data.base_model == "Qwen/Qwen2.5-1.5B-Instruct"
    assert loaded.data.datasets == ["trl-lib/DeepMath-103K"]
    assert "--config recipes/grpo_qwen.yaml --max_steps 2" in loaded.text
    assert "dataset_name: trl-lib/DeepMath-103K" in loaded.text
    assert "Logged at step 2:" in loaded.text
    assert "| `reward` | 0.875 |" in loaded.text and "| `rewards/letters_reward/mean` | 0.875 |" in loaded.text
    assert "on 8 processes" in loaded.text


@pytest.mark.parametrize(
    "env, launcher",
    [({}, "python"),
     ({"LOCAL_RANK": "0", "ACCELERATE_MIXED_PRECISION": "no"}, "accelerate launch"),
     ({"LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"}, "torchrun --nproc_per_node 2")],
)  # fmt: skip
def test_the_card_names_the_launcher_and_where_the_recipe_is(root, tmp_path, monkeypatch, env, launcher):
    for name in [n for n in __import__("os").environ if n.startswith(("ACCELERATE_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    inside = Recipe.from_argv(["--config", str(root / "recipes/grpo_tiny.yaml")], "colograd:tiny-qwen2", None)
    text = model_card("m", None, inside, HISTORY, world_size=1).text
    assert f"```bash\n{launcher} colograd/train.py --config recipes/grpo_tiny.yaml\n```" in text
    assert "`recipes/grpo_tiny.yaml` of the colograd repository" in text
    own = tmp_path / "mine.yaml"
    own.write_text("max_steps: 2\n")
    text = model_card("m", None, Recipe.from_argv(["--config", str(own)], None, None), HISTORY, world_size=1).text
    assert "colograd repository" not in text and f"`{own}` (a file of the run's own, embedded below)" in text


def test_card_of_a_run_from_python_has_no_recipe_and_no_fake_hub_ids(tmp_path):
    card = model_card("tiny", str(tmp_path), None, HISTORY[:1], world_size=1)
    assert card.data.base_model is None and card.data.datasets is None  # a local folder is not a Hub id
    assert "not from a recipe file" in card.text and "| `reward` | 0.25 |" in card.text


@pytest.mark.slow
def test_push_to_hub_uploads_the_card(tmp_path, monkeypatch):
    """`push_to_hub` (transformers') writes the card through `create_model_card` before uploading: the Hub is
    replaced by a stand-in that reads the folder at upload time."""
    uploads = []

    class Hub:
        def create_repo(self, repo_id: str, **kwargs) -> SimpleNamespace:
            return SimpleNamespace(repo_id=repo_id)

        def upload_folder(self, repo_id: str, folder_path: str, **kwargs) -> None:
            uploads.append((repo_id, ModelCard.load(Path(folder_path) / "README.md")))

    monkeypatch.setattr(transformers.trainer, "hf_api", Hub)
    args = GRPOConfig(output_dir=str(tmp_path), hub_model_id="me/tiny-grpo", max_steps=1, num_generations=8,
                      per_device_train_batch_size=16, max_prompt_length=16, max_completion_length=8,
                      vllm_kv_cache_gib=0.1, vllm_enforce_eager=True, save_strategy="no", report_to="none",
                      disable_tqdm=True)  # fmt: skip
    trainer = GRPOTrainer(
        tiny.build_model(), "letters", args, tiny.letters_dataset(16), processing_class=tiny.build_tokenizer()
    )
    trainer.train()
    trainer.push_to_hub()

    ((repo_id, card),) = uploads
    assert repo_id == "me/tiny-grpo" and card.data.model_name == "tiny-grpo"
    assert {"colograd", "grpo"} <= set(card.data.tags) and "Logged at step 1:" in card.text
