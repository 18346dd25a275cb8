"""Vision-language GRPO on the tiny LLaVA (`colograd.models.tiny_vlm`): bad image data refused before start-up, and,
with
the real engine, parity of the engine's and the trainer's log-probs on image rollouts, the engine's expansion of the
placeholders checked against the processor's, and a colour-naming task that learns."""

import json
import math
import re

import pytest
import torch
from conftest import ROOT, run_cli
from datasets import Dataset
from PIL import Image

from colograd import GRPOTrainer
from colograd.engine.requests import Sampling
from colograd.errors import ConfigError
from colograd.models.tiny import build_model as build_text_model
from colograd.models.tiny import run_config
from colograd.models.tiny_vlm import (
    COLOURS,
    QUESTION,
    build_model,
    build_processor,
    colour_reward,
    colours_dataset,
    save_tiny_llava_next,
    save_tiny_vlm,
    solid_image,
)
from colograd.runs import completions
from colograd.runs.completions import CompletionLog
from colograd.vision.checks import check_image_data
from colograd.vision.core import check_expansion, forward_images, freeze_vision_tower, pad_pixels

USER = [{"role": "user", "content": QUESTION}]


def _rows(**columns) -> Dataset:
    return Dataset.from_dict({"prompt": [USER], **{k: [v] for k, v in columns.items()}})


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ({"image": "/nowhere/red.png"}, "does not exist"),
        ({"image": "a red square"}, "is text"),
        ({"images": [solid_image("red")] * 2}, None),  # accepted: plain-text messages take any number of images
    ],
)
def test_bad_image_values(columns, message):
    dataset = _rows(**columns)
    model, processor = build_model(), build_processor()
    if message is None:
        assert check_image_data(model, processor, dataset)[0] == 2
        return
    with pytest.raises(ConfigError, match=message) as err:
        check_image_data(model, processor, dataset)
    assert "\n" not in str(err.value)


def test_bad_image_data(tmp_path):
    model, processor = build_model(), build_processor()
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(ConfigError, match="not an image file"):
        check_image_data(model, processor, _rows(image=str(broken)))
    with pytest.raises(ConfigError, match="takes no images"):
        check_image_data(build_text_model(), processor, _rows(image=solid_image("red")))
    text_prompt = Dataset.from_dict({"prompt": ["colour?"], "image": [solid_image("red")]})
    with pytest.raises(ConfigError, match="conversational"):
        check_image_data(model, processor, text_prompt)
    one_part = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    two_images = Dataset.from_dict({"prompt": [one_part], "images": [[solid_image("red"), solid_image("blue")]]})
    with pytest.raises(ConfigError, match="row 0: 2 images for the prompt's 1 image part;"):
        check_image_data(model, processor, two_images)
    assert check_image_data(model, processor, _rows(prompt_only=1)) == (0, None)
    with pytest.raises(ConfigError, match="^eval_dataset row 0: 'image' is text"):
        check_image_data(model, processor, _rows(image="red"), name="eval_dataset")


def test_pixels_travel_per_completion():
    """Each prompt's processor outputs repeat for its G completions and come back, for any slice of rows, as the
    model takes them: the rows' images concatenated in row order, text-only rows adding none."""
    a, b = torch.full((1, 3, 2, 2), 1.0), torch.stack([torch.full((3, 2, 2), 2.0), torch.full((3, 2, 2), 3.0)])
    batch = pad_pixels([{"pixel_values": a}, {}, {"pixel_values": b}], num_generations=2)
    assert batch["mm_pixel_values"].shape == (6, 2, 3, 2, 2)
    assert batch["mm_pixel_values_len"].tolist() == [1, 1, 0, 0, 2, 2]
    values = forward_images({k: v[3:6] for k, v in batch.items()})["pixel_values"]
    assert values[:, 0, 0, 0].tolist() == [2.0, 3.0, 2.0, 3.0]
    assert forward_images({k: v[2:4] for k, v in batch.items()}) == {}
    with pytest.raises(RuntimeError, match="expanded its image placeholders to 7 tokens"):
        check_expansion([[5, 9, 9, 9, 9, 9, 9]], [[5, 9, 9, 9, 9]])


def test_pixels_of_different_shapes_travel_apart():
    """A tiling processor's images differ in more than their count (LLaVA-Next: [images, crops, C, H, W], crops by
    aspect ratio): each dimension pads to the largest and every image comes back whole, with zeros after."""
    square, wide = torch.full((1, 2, 3, 4, 4), 1.0), torch.full((1, 3, 3, 4, 4), 2.0)
    batch = pad_pixels([{"pixel_values": square}, {"pixel_values": wide}], num_generations=2)
    assert batch["mm_pixel_values"].shape == (4, 1, 3, 3, 4, 4)
    values = forward_images(batch)["pixel_values"]
    assert values.shape == (4, 3, 3, 4, 4)
    assert torch.equal(values[0, :2], square[0]) and not values[0, 2].any() and torch.equal(values[3], wide[0])


@pytest.mark.slow
def test_a_tiling_model_trains_on_images_of_every_aspect_ratio(tmp_path):
    """LLaVA-Next (the tiny one: `save_tiny_llava_next`) on the CPU engine: a square, a wide and a tall image in one
    rollout expand to different numbers of tokens and carry 2 or 3 crops each; the trainer's log-probs of every
    completion equal the engine's, and another prompt's image in their place does not."""
    path = save_tiny_llava_next(str(tmp_path / "tiny-llava-next"))
    sizes, colours = [(28, 28), (56, 28), (28, 56)], ["red", "blue", "green"]
    rows = {
        "prompt": [USER] * 3,
        "images": [[Image.new("RGB", size, COLOURS[c])] for size, c in zip(sizes, colours, strict=True)],
        "colour": colours,
    }
    data = Dataset.from_dict({key: values * 4 for key, values in rows.items()})
    args = run_config(str(tmp_path / "out"), 40, max_prompt_length=None, per_device_train_batch_size=24,
                      num_generations=8, max_completion_length=6,
                      vllm_importance_sampling_correction=True)  # fmt: skip
    trainer = GRPOTrainer(path, colour_reward, args, data)
    batch = trainer.make_rollout([data[i] for i in range(3)])[0]  # check_expansion ran inside: a mismatch raises
    crops = (batch["mm_pixel_values"][:, 0].flatten(2).abs().sum(-1) > 0).sum(-1)  # each row's one image
    assert crops.tolist() == [2] * 8 + [3] * 16
    lengths = batch["attention_mask"].sum(1) - batch["completion_mask"].sum(1)
    assert len(set(lengths[::8].tolist())) == 3  # the three prompts expand to three lengths
    policy = trainer.accelerator.unwrap_model(trainer.model)
    mask = batch["completion_mask"].bool()
    with torch.no_grad():
        gap = (trainer.completion_logps(policy, batch) - batch["engine_logps"])[mask].abs().max().item()
        swapped = {**batch, "mm_pixel_values": batch["mm_pixel_values"].flip(0)}
        wrong = (trainer.completion_logps(policy, swapped) - batch["engine_logps"])[mask].abs().max().item()
    assert gap < 1e-4, gap
    assert wrong > 100 * max(gap, 1e-6)


@pytest.mark.slow
def test_image_rollouts_match_and_learn(tmp_path):
    """One engine, fp32: (1) a rollout of mixed rows (text only, one image, two images; prompts of different
    lengths, so left padding) trains on the engine's own expansion, which equals the processor's; the trainer's
    log-probs of every completion equal the engine's at text tolerance; ids expanded before the engine (TRL 1.16's
    path) are expanded again and fail the check. (2) The colour task's reward rises from `GRPOTrainer(...)`, and
    from `colograd/train.py --config recipes/grpo_tiny_vlm.yaml`."""
    path = save_tiny_vlm(str(tmp_path / "tiny-llava"))
    colours = ["red", "blue", "green"]
    mixed = Dataset.from_dict(
        {
            "prompt": [USER, [{"role": "user", "content": "say a colour name please"}], USER] * 4,
            "images": [[solid_image("red")], [], [solid_image(c) for c in colours[:2]]] * 4,
            "colour": ["red", "red", "blue"] * 4,
        }
    )
    args = run_config(
        str(tmp_path / "out"),
        40,
        max_prompt_length=None,
        per_device_train_batch_size=24,
        num_generations=8,
        max_completion_length=6,
        vllm_importance_sampling_correction=True,  # every completion then carries the engine's log-probs
        logging_steps=1,
        log_completions=True,
        log_completions_steps=1,  # the rollout below is made outside train(), before the state knows logging_steps
    )
    trainer = GRPOTrainer(path, colour_reward, args, mixed)
    rows = [mixed[i] for i in range(3)]
    batch = trainer.make_rollout(rows)[0]  # check_expansion ran inside: a mismatch raises
    assert batch["mm_pixel_values_len"].tolist() == [1] * 8 + [0] * 8 + [2] * 8
    logged = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert [row["image_sizes"] for row in logged] == [[[28, 28]]] * 8 + [[]] * 8 + [[[28, 28]] * 2] * 8
    pad = trainer.processing_class.tokenizer.pad_token_id
    assert (batch["input_ids"][:8, 0] == pad).all()  # the one-image prompt is left-padded (the text one is longer)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        logps = trainer.completion_logps(policy, batch)
    mask = batch["completion_mask"].bool()
    gap = (logps - batch["engine_logps"])[mask].abs().max().item()
    assert gap < 1e-4, gap
    # Another image scored for the same completions: the gap metric sees it.
    swapped = {**batch, "mm_pixel_values": batch["mm_pixel_values"].flip(0)}
    with torch.no_grad():
        wrong = (trainer.completion_logps(policy, swapped) - batch["engine_logps"])[mask].abs().max().item()
    assert wrong > 100 * max(gap, 1e-6)

    # TRL 1.16 sends ids with the placeholders already expanded: vLLM expands them again.
    prepared = trainer.prepare_prompts(rows[:1])
    expanded = prepared.images.expanded_ids
    trainer.sync_for_rollout()
    with trainer.engine.awake():
        rollout = trainer.engine.generate(
            expanded, Sampling.of(args), images=prepared.images.images, num_generations=2
        )
    assert len(rollout.engine_prompt_ids[0]) > len(expanded[0])
    with pytest.raises(RuntimeError, match="expanded its image placeholders"):
        check_expansion(rollout.engine_prompt_ids, expanded)
    del trainer

    trainer = GRPOTrainer(path, colour_reward, run_config(str(tmp_path / "colours"), 40, **_colour_settings()),
                          colours_dataset())  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    rewards = [h["reward"] for h in logs]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.1, rewards
    gaps = [h["sampling/sampling_logp_difference/max"] for h in logs]
    assert all(not math.isnan(g) and g < 1e-3 for g in gaps), gaps
    del trainer

    # The same from the command line, with the recipe.
    recipe = str(ROOT / "recipes/grpo_tiny_vlm.yaml")
    proc = run_cli("--config", recipe, "--max_steps", "24", "--output_dir", str(tmp_path / "cli"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [float(r) for r in re.findall(r"'reward': '?([0-9.e+-]+)", proc.stdout + proc.stderr)][:24]
    assert sum(rewards[-6:]) / 6 > sum(rewards[:6]) / 6 + 0.05, rewards


def _colour_settings() -> dict:
    return dict(
        max_prompt_length=None,
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=6,
        logging_steps=1,
    )


class Tracker:
    """Stands in for wandb / trackio: keeps the tables logged; its images wrap what they were given."""

    def __init__(self) -> None:
        self.tables = []

    class Image:
        def __init__(self, value) -> None:
            self.value = value

    def Table(self, dataframe):  # noqa: N802 — the trackers' name
        return dataframe

    def log(self, entry) -> None:
        self.tables.append(entry["completions"])


def _log_rollout(tmp_path, monkeypatch, images, unique_prompts=False):
    """Record a rollout of two prompts × 2 completions with `images`; return the JSONL rows and the tracker's
    table."""
    tracker = Tracker()
    monkeypatch.setattr(completions, "trackers", lambda report_to: [tracker])
    log = CompletionLog(str(tmp_path), num_to_print=0, unique_prompts=unique_prompts, report_to=["trackio"])
    log.record(1, [USER, USER], ["red", "re", "blue", "b"], {"colour": [1.0, 0.2, 1.0, 0.1]}, [1.0, 0.2, 1.0, 0.1],
               [0.7, -0.7, 0.7, -0.7], images=images)  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    return rows, tracker.tables[0]


def test_completions_table_carries_each_completions_images(tmp_path, monkeypatch):
    red, blue, wide = solid_image("red"), solid_image("blue"), Image.new("RGB", (40, 20))
    rows, table = _log_rollout(tmp_path, monkeypatch, [[red], [blue, wide]])
    # TRL's column: last, one list of the tracker's images per completion, the group's prompt images in order.
    assert list(table.columns) == ["step", "prompt", "completion", "colour", "advantage", "image"]
    assert [[im.value for im in cell] for cell in table["image"]] == [[red], [red], [blue, wide], [blue, wide]]
    assert all(isinstance(im, Tracker.Image) for cell in table["image"] for im in cell)
    # The file keeps sizes, not pixels: [width, height] of each image.
    assert [row["image_sizes"] for row in rows] == [[[28, 28]]] * 2 + [[[28, 28], [40, 20]]] * 2
    # A text-only row beside an image row: an empty list, in the table and in the file.
    rows, table = _log_rollout(tmp_path / "mixed", monkeypatch, [[], [red]])
    assert [len(cell) for cell in table["image"]] == [0, 0, 1, 1] and rows[0]["image_sizes"] == []
    # log_unique_prompts: the rows shown keep their own images (both prompts are the same text: TRL shows one).
    _, table = _log_rollout(tmp_path / "unique", monkeypatch, [[red], [blue]], unique_prompts=True)
    assert len(table) == 1 and table["image"][0][0].value is red


@pytest.mark.parametrize("images", [None, [[], []]])
def test_completions_table_has_no_image_column_without_images(tmp_path, monkeypatch, images):
    """Not logged (log_multimodal false, or a text model: None), or a rollout of text-only rows."""
    rows, table = _log_rollout(tmp_path, monkeypatch, images)
    assert "image" not in table.columns and all("image_sizes" not in row for row in rows)


def test_log_multimodal_is_a_logging_option_with_trls_default():
    import trl

    from colograd.config.core import GRPOConfig
    from colograd.config.logging import LoggingOptions

    assert "log_multimodal" in LoggingOptions.__dataclass_fields__
    assert GRPOConfig.__dataclass_fields__["log_multimodal"].default is True
    assert trl.GRPOConfig.__dataclass_fields__["log_multimodal"].default is True
    assert "No effect" not in GRPOConfig.__dataclass_fields__["log_multimodal"].metadata["help"]


def test_processor_image_token_is_one_token():
    processor = build_processor()
    ids = processor.tokenizer("u:<image>colour?;a:", add_special_tokens=False)["input_ids"]
    assert ids.count(processor.image_token_id) == 1
    out = processor(text=["u:<image>colour?;a:"], images=[Image.new("RGB", (28, 28))], return_tensors="pt")
    assert out["input_ids"][0].tolist().count(processor.image_token_id) == 4


def test_freeze_vision_tower():
    model = build_model()
    frozen = freeze_vision_tower(model)
    assert frozen == sum(p.numel() for p in model.model.vision_tower.parameters()) > 0
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and not any("vision_tower" in n for n in trained)
    assert any("multi_modal_projector" in n for n in trained)
    with pytest.raises(ConfigError, match="has no vision tower"):
        freeze_vision_tower(build_text_model())


def test_the_tiny_llava_is_built_whole_while_a_zero3_config_is_active():
    """Under ZeRO-3 (`zero3_init_flag: false`, as the tiny Qwen2 is built) the tiny LLaVA is built whole for
    DeepSpeed to partition when it wraps it: transformers would otherwise partition its towers at construction
    (they are built through `AutoModel.from_config`) and fail to initialise the empty shards. The config active
    before stays active after. (2 processes under tests/configs/zero3_cpu.yaml trained it with a sampling gap of
    4.8e-7, run by hand.)"""
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    from colograd.models import tiny_vlm

    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    model = tiny_vlm.build_model()
    assert is_deepspeed_zero3_enabled()
    assert all(p.numel() > 0 for p in model.parameters())
    assert torch.equal(model.lm_head.weight, tiny_vlm.build_model().lm_head.weight)  # seeded, as on every rank
    del config


def test_a_vision_language_model_trained_on_text_gets_a_language_model_only_engine(tmp_path):
    """With its processor, a vision-language model's engine takes images (normalised on the host, no video); with a
    tokenizer alone (text-only training, as a Qwen3.5 checkpoint's users start) it is vLLM's language-model-only
    engine, which needs no image processor in its folder (the engine failed at start-up looking for one)."""
    from colograd.config.core import GRPOConfig
    from colograd.engine.settings import engine_settings

    args = GRPOConfig(output_dir=str(tmp_path), report_to="none")
    model, processor = build_model(), build_processor()
    with_images = engine_settings(model, processor, args)
    assert with_images["limit_mm_per_prompt"]["video"] == 0 and with_images["mm_device_do_normalize"] is False
    assert "language_model_only" not in with_images
    text_only = engine_settings(model, processor.tokenizer, args)
    assert text_only["language_model_only"] is True and "limit_mm_per_prompt" not in text_only
    assert "language_model_only" not in engine_settings(build_text_model(), processor.tokenizer, args)
