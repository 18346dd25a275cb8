"""Qwen2-VL / Qwen2.5-VL (the tiny ones: `colograd.models.tiny_vlm.save_tiny_qwen_vl`) without torchvision: their
processors load with the stills-only stand-in for the video processor (`colograd.vision.qwen`), images of every
aspect ratio keep their own patch counts, and, with the real engine, the trainer's log-probs (M-RoPE positions
computed by the model from the images) equal the engine's."""

import time

import pytest
import torch
from datasets import Dataset
from PIL import Image

from colograd import GRPOTrainer
from colograd.errors import ConfigError
from colograd.models.tiny import run_config
from colograd.models.tiny_vlm import COLOURS, QUESTION, colour_reward, save_tiny_qwen_vl
from colograd.vision.checks import check_processor
from colograd.vision.core import forward_images, load_pretrained, pad_pixels, placeholder_ids

USER = [{"role": "user", "content": QUESTION}]
# (width, height): 4, 3 and 2 image tokens (grids of 4 x 4, 2 x 6 and 4 x 2 patches).
SIZES = [(56, 56), (84, 28), (28, 56)]


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory) -> str:
    return save_tiny_qwen_vl(str(tmp_path_factory.mktemp("qwen") / "tiny-qwen2.5-vl"))


def test_a_qwen_processor_loads_without_torchvision_and_keeps_each_images_patches(tiny_qwen):
    """AutoProcessor of the saved folder (as the trainer and vLLM load it) gives Qwen2.5-VL's processor; a square, a
    wide and a tall image give their own grids and token counts; their pixels travel per image and come back whole;
    a video is refused in one line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor

    processor = load_pretrained(tiny_qwen, AutoTokenizer)
    assert isinstance(processor, Qwen2_5_VLProcessor)
    # Neither placeholder is ever sampled: the engine's logit bias and the trainer's log-softmax leave both out.
    assert placeholder_ids(processor) == [processor.image_token_id, processor.video_token_id]
    model = load_pretrained(tiny_qwen, AutoModelForCausalLM)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    outs = [processor(text=[processor.image_token], images=[Image.new("RGB", s)], return_tensors="pt") for s in SIZES]
    assert [o["image_grid_thw"].tolist() for o in outs] == [[[1, 4, 4]], [[1, 2, 6]], [[1, 4, 2]]]
    assert [o["input_ids"][0].tolist().count(processor.image_token_id) for o in outs] == [4, 3, 2]
    pixels = [{k: o[k] for k in ("pixel_values", "image_grid_thw")} for o in outs]
    batch = pad_pixels(pixels, num_generations=2)
    assert batch["mm_pixel_values"].shape == (6, 16, 1176)
    assert batch["mm_pixel_values_len"].tolist() == [16, 16, 12, 12, 8, 8]
    back = forward_images({k: v[1:4] for k, v in batch.items()})
    square, wide = outs[0]["pixel_values"], outs[1]["pixel_values"]
    assert torch.equal(back["pixel_values"], torch.cat([square, wide, wide]))  # 16 + 12 + 12 patches, no padding
    assert back["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 6], [1, 2, 6]]
    with pytest.raises(NotImplementedError, match="videos need torchvision"):
        processor.video_processor(videos=[torch.zeros(2, 3, 28, 28)])


def test_the_command_line_loads_a_qwen_vl_folder_as_the_trainer_does(tiny_qwen):
    """`colograd/train.py` (recipes/grpo_qwen2_5_vl.yaml with a model folder): the folder's checks build the model it
    describes as an image-text model, the processing class is the processor and the model the image-text one, where
    the causal-LM classes it used refused the config ("Unrecognized configuration class ... Qwen2_5_VLConfig")."""
    import importlib.util

    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from trl import ModelConfig

    from colograd.models import model_files

    spec = importlib.util.spec_from_file_location("train_script", "colograd/train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    model_files.check_model_folder(tiny_qwen)
    args = ModelConfig(model_name_or_path=tiny_qwen)
    config, processor, _ = train.load_model_config(args, run_config("/tmp/unused", 1, max_prompt_length=None))
    assert isinstance(processor, Qwen2_5_VLProcessor) and config.model_type == "qwen2_5_vl"
    model, _ = train.load_model(args, run_config("/tmp/unused", 1, max_prompt_length=None))
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"


def test_a_qwen_processor_is_checked_against_the_model(tiny_qwen):
    """The model's own processor passes; one that merges patches otherwise, or cuts other patches, is refused in one
    line before the engine starts (its token counts would not be the model's features)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    processor = load_pretrained(tiny_qwen, AutoTokenizer)
    model = load_pretrained(tiny_qwen, AutoModelForCausalLM)
    check_processor(model, processor)
    processor.image_processor.merge_size = 1
    with pytest.raises(ConfigError, match=r"merge size \(patches per token side\) is 1 where the model's is 2") as err:
        check_processor(model, processor)
    assert "\n" not in str(err.value)
    processor.image_processor.merge_size, processor.image_processor.patch_size = 2, 7
    with pytest.raises(ConfigError, match="its patch size is 7 where the model's is 14"):
        check_processor(model, processor)


def test_mm_token_type_ids_are_rebuilt_for_own_position_models(tiny_qwen):
    """Qwen-VL's M-RoPE reads which tokens are image placeholders: rebuilt from each forward's ids (1 at
    `<|image_pad|>`, 0 elsewhere), not carried from the processor; a LLaVA gets none."""
    from transformers import AutoConfig

    from colograd.models.tiny_vlm import model_config

    config = AutoConfig.from_pretrained(tiny_qwen)
    pad, video = config.image_token_id, config.video_token_id
    batch = {
        "input_ids": torch.tensor([[0, 5, pad, pad, 7, video]]),
        **pad_pixels([{"image_grid_thw": torch.tensor([[1, 2, 4]])}], 1),
    }
    assert forward_images(batch, config)["mm_token_type_ids"].tolist() == [[0, 0, 1, 1, 0, 0]]
    assert "mm_token_type_ids" not in forward_images(batch, model_config())
    assert forward_images({"input_ids": batch["input_ids"]}, config) == {}  # no image: nothing to place


def test_a_banner_the_qwen_processor_refuses_is_named_with_its_row_before_start_up_and_at_its_rollout(tiny_qwen):
    """A 1000x4 banner (aspect ratio 250, over Qwen-VL's 200): transformers' bare ValueError, with no row, is now one
    line naming the row, the image's size and the fix, from preflight's sample and from the rollout that reads a row
    past it (a dynamic-sampling refill reads its rows through the same rollout)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from colograd.data.streaming import ROW_KEY
    from colograd.vision.checks import check_image_data

    processor = load_pretrained(tiny_qwen, AutoTokenizer)
    model = load_pretrained(tiny_qwen, AutoModelForCausalLM)
    banner = Image.new("RGB", (1000, 4), "red")
    good = {"prompt": USER, "image": Image.new("RGB", (56, 56), "blue")}
    expected = (
        "the processor refuses its image (1000x4): absolute aspect ratio must be smaller than 200, got 250.0; pad or "
        "crop the image to an aspect ratio the processor takes (e.g. PIL.ImageOps.pad), or drop the row."
    )
    with pytest.raises(ConfigError) as err:
        check_image_data(model, processor, Dataset.from_list([good] * 3 + [{"prompt": USER, "image": banner}]))
    assert str(err.value) == f"train_dataset row 3: {expected}"
    fake = SimpleNamespace(
        _vision=True,
        inputs=SimpleNamespace(images_per_prompt=1),
        processing_class=processor,
        args=run_config("/tmp/unused", 1, max_prompt_length=None),
        prompt_limit=4096,
        accelerator=SimpleNamespace(num_processes=1, process_index=0),
        engine=SimpleNamespace(),  # `awake` / `generate` missing: an AttributeError if the rollout reached it
    )
    fake.prepare_prompts = lambda rows: GRPOTrainer.prepare_prompts(fake, rows)
    rows = [
        {**good, ROW_KEY: "train_dataset row 40"},
        {"prompt": USER, "image": banner, ROW_KEY: "train_dataset row 7000"},
    ]
    with pytest.raises(ConfigError) as err:
        GRPOTrainer.sample(fake, rows)
    assert str(err.value) == f"train_dataset row 7000: {expected}"


@pytest.mark.slow
@pytest.mark.parametrize("version", ["2.5", "2"])
def test_a_qwen_vl_trains_on_images_of_every_aspect_ratio(version, tiny_qwen, tmp_path):
    """Qwen2.5-VL and Qwen2-VL on the CPU engine: a square, a wide and a tall image in one rollout expand to 4, 3
    and 2 tokens; the trainer's log-probs of every completion (its M-RoPE positions computed by the model from the
    images) equal the engine's, and another prompt's image in their place does not. Qwen2.5-VL then trains two
    steps, and the engine's log-probs stay the trainer's after the sync (the sampling-gap metric). Qwen2-VL's engine
    is compiled (the default), so vLLM profiles its encoder at start-up: with images, not with a dummy video the
    stills-only video processor would refuse."""
    colours = ["red", "blue", "green"]
    rows = {
        "prompt": [USER] * 3,
        "images": [[Image.new("RGB", size, COLOURS[c])] for size, c in zip(SIZES, colours, strict=True)],
        "colour": colours,
    }
    data = Dataset.from_dict({key: values * 4 for key, values in rows.items()})
    args = run_config(str(tmp_path / "out"), 2, max_prompt_length=None, per_device_train_batch_size=24,
                      num_generations=8, max_completion_length=6, logging_steps=1,
                      vllm_importance_sampling_correction=True,
                      vllm_enforce_eager=version == "2.5")  # fmt: skip
    start = time.perf_counter()
    path = tiny_qwen if version == "2.5" else save_tiny_qwen_vl(str(tmp_path / "tiny-qwen2-vl"), version="2")
    trainer = GRPOTrainer(path, colour_reward, args, data)
    batch = trainer.make_rollout([data[i] for i in range(3)])[0]  # check_expansion ran inside: a mismatch raises
    assert batch["mm_image_grid_thw"][::8, 0].tolist() == [[1, 4, 4], [1, 2, 6], [1, 4, 2]]
    assert batch["mm_pixel_values_len"][::8].tolist() == [16, 12, 8]
    lengths = batch["attention_mask"].sum(1) - batch["completion_mask"].sum(1)
    assert lengths[::8].tolist() == [18, 17, 16]  # the three prompts expand to three lengths
    policy = trainer.accelerator.unwrap_model(trainer.model)
    assert trainer.engine.llm.llm_engine.model_config.architectures == [type(policy).__name__]
    mask = batch["completion_mask"].bool()
    with torch.no_grad():
        gap = (trainer.completion_logps(policy, batch) - batch["engine_logps"])[mask].abs().max().item()
        swapped = {**batch, "mm_pixel_values": batch["mm_pixel_values"].flip(0)}
        wrong = (trainer.completion_logps(policy, swapped) - batch["engine_logps"])[mask].abs().max().item()
    print(f"gap {gap:.3g} swapped {wrong:.3g} in {time.perf_counter() - start:.1f} s")
    assert gap < 1e-4, gap
    assert wrong > 100 * max(gap, 1e-6)
    if version == "2":
        return
    # Two steps: the second rollout is sampled after a sync of every weight, vision tower included.
    visual = policy.model.visual.patch_embed.proj.weight.detach().clone()
    trainer.train()
    gaps = [h["sampling/sampling_logp_difference/max"] for h in trainer.state.log_history if "loss" in h]
    assert len(gaps) == 2 and max(gaps) < 1e-4, gaps
    assert not torch.equal(policy.model.visual.patch_embed.proj.weight, visual)


def test_a_qwen3_5_checkpoints_processor_loads_without_torchvision(tmp_path):
    """Qwen3.5 as published (tests/zoo.py: the shrunk Qwen3.5-4B behind its vision tower, saved with Qwen3-VL's
    processor): the processor loads with the stills-only stand-in for Qwen3-VL's video processor, which keeps what
    vLLM reads from it at start-up (its pixel bounds as `size`, the temporal patch); 16-pixel patches merged 2 x 2 give
    a square, a wide and a tall image their own grids and token counts; the model takes them; a video is refused."""
    import zoo
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.qwen3_vl import Qwen3VLProcessor

    folder = zoo.save_as_published_with_images("Qwen/Qwen3.5-4B", str(tmp_path / "qwen3.5"))
    processor = load_pretrained(folder, AutoTokenizer)
    assert isinstance(processor, Qwen3VLProcessor)
    assert placeholder_ids(processor) == [248056, 248057]  # Qwen3.5's image and video tokens, at their real ids
    video = processor.video_processor
    assert video.size["longest_edge"] == 32 * 32 * 768 and video.temporal_patch_size == 2 and video.patch_size == 16
    sizes = [(64, 64), (96, 32), (32, 64)]
    prompt = ["<u>" + processor.image_token + QUESTION]
    outs = [processor(text=prompt, images=[Image.new("RGB", s)], return_tensors="pt") for s in sizes]
    assert [o["image_grid_thw"].tolist() for o in outs] == [[[1, 4, 4]], [[1, 2, 6]], [[1, 4, 2]]]
    assert [o["input_ids"][0].tolist().count(processor.image_token_id) for o in outs] == [4, 3, 2]
    model = load_pretrained(folder, AutoModelForCausalLM)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    with torch.no_grad():
        assert torch.isfinite(model(**outs[1]).logits).all()
    with pytest.raises(NotImplementedError, match="videos need torchvision"):
        video(videos=[torch.zeros(2, 3, 32, 32)])
