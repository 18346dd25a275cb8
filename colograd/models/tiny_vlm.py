"""A tiny vision-language model, processor and image task built locally, so VLM runs and tests need no download.

The model is a LLaVA: a 2-layer CLIP vision tower (28-pixel images, 14-pixel patches, hidden 32), a projector and the
tiny 2-layer Qwen2 of `colograd.models.tiny` (hidden 128, 2 heads of 64, sizes vLLM's CPU attention accepts). An image
becomes 4 placeholder tokens (2 × 2 patches; the CLS feature is dropped). The processor's image processor is the PIL
one, which needs no torchvision.

Two variable-resolution models share its vocabulary: a tiny LLaVA-Next (`save_tiny_llava_next`: crops by aspect
ratio) and a tiny Qwen2.5-VL or Qwen2-VL (`save_tiny_qwen_vl`: patches by aspect ratio, M-RoPE positions).

The task is "name the colour": each prompt shows one solid-colour image and asks the same question, so only the
image tells the completions apart. A randomly initialised model answers at random; the reward rises as the
projector and the language model learn to read the colour.
"""

import os
import random
from typing import Any

from datasets import Dataset
from PIL import Image
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    CLIPVisionConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextProcessor,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    Qwen2Config,
)
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

from colograd.models import tiny
from colograd.models.model_files import built_whole
from colograd.models.tiny import _CHARS, _SPECIALS

TINY_VLM = "colograd:tiny-llava"  # its name as a recipe's model_name_or_path
IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 28
# Colours whose names start with different letters, so a partial answer (the initial) is already graded.
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}
QUESTION = "colour?"


def build_processor() -> LlavaProcessor:
    """A LLaVA processor over the character vocabulary of `colograd.models.tiny`, with `<image>` as one more token.

    Its chat template writes TRL's multimodal messages (content lists of `{"type": "image"}` and `{"type": "text"}`
    parts) as ``u:<image>colour?;a:`` — one `<image>` per image part, unexpanded.
    """
    tokenizer = _char_tokenizer([IMAGE_TOKEN], IMAGE_TOKEN, {"image_token": IMAGE_TOKEN})
    template = tokenizer.chat_template = _chat_template(IMAGE_TOKEN)
    image_processor = LlavaImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_pad=False,
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        # The CLS feature the vision tower adds: without it the processor counts one placeholder too few.
        num_additional_image_tokens=1,
        chat_template=template,
    )


def _char_tokenizer(extra: list[str], whole: str, special: dict[str, str]) -> PreTrainedTokenizerFast:
    """The character vocabulary of `colograd.models.tiny` and the tokens `extra` after it: text matching the regex
    `whole` is one token, everything else is split into characters; `special` names the extra tokens' roles."""
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(_SPECIALS + _CHARS + extra)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"{whole}|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", extra_special_tokens=special
    )


def _chat_template(image: str) -> str:
    """The tiny models' chat template: TRL's multimodal messages as ``u:<image>colour?;a:``, `image` for each image
    part, unexpanded."""
    return (
        "{% for m in messages %}{{ m['role'][0] }}:"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for part in m['content'] %}{% if part['type'] == 'image' %}" + image + "{% else %}"
        "{{ part['text'] }}{% endif %}{% endfor %}{% endif %};{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )


def _seeded(model_class: type, config: Any, seed: int) -> Any:
    """`model_class(config)` initialised from `seed` (the same on every rank, the global generator untouched), built
    whole under a ZeRO-3 config (`built_whole`), ending and padding with the tiny vocabulary's ids."""
    import torch

    with torch.random.fork_rng(), built_whole():
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
    return model


def build_model(
    seed: int = 0, tie_word_embeddings: bool = False, text_config: Qwen2Config | None = None
) -> LlavaForConditionalGeneration:
    """A randomly initialised tiny LLaVA (~0.5M parameters), identical for a given seed on every rank.

    Args:
        seed: the initialisation's seed.
        tie_word_embeddings: tie the language model's output layer to its input embedding.
        text_config: another language model over the same vocabulary (a wider one, for the VLM benchmark); its
            own `tie_word_embeddings` then holds. Default: the tiny Qwen2 of `colograd.models.tiny`.
    """
    return _seeded(LlavaForConditionalGeneration, model_config(tie_word_embeddings, text_config), seed)


def model_config(tie_word_embeddings: bool = False, text_config: Qwen2Config | None = None) -> LlavaConfig:
    """The tiny LLaVA's config (see `build_model`), built without a model: what a run reads before the weights."""
    image_token_id = len(_SPECIALS) + len(_CHARS)
    text = text_config or tiny.model_config(tie_word_embeddings)
    tie_word_embeddings = text.tie_word_embeddings
    vision = CLIPVisionConfig(
        image_size=IMAGE_SIZE,
        patch_size=14,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=32,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=image_token_id,
        image_seq_length=4,  # (28 / 14)² patches
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=tie_word_embeddings,
    )
    config.pad_token_id, config.eos_token_id = 0, 1
    return config


def save_tiny_vlm(folder: str, seed: int = 0) -> str:
    """Write the tiny LLaVA and its processor to `folder` (a model path for `GRPOTrainer` or a recipe); returns it."""
    os.makedirs(folder, exist_ok=True)
    build_model(seed).save_pretrained(folder)
    build_processor().save_pretrained(folder)
    return folder


# LLaVA-Next's tiles: an image is resized to the best of these resolutions for its aspect ratio and cut into 28-pixel
# crops, which follow a 28-pixel overview of the whole image: 2 crops for a square image, 3 for a wide or a tall one.
NEXT_GRID = [[IMAGE_SIZE, IMAGE_SIZE], [IMAGE_SIZE, 2 * IMAGE_SIZE], [2 * IMAGE_SIZE, IMAGE_SIZE]]


def save_tiny_llava_next(folder: str, seed: int = 0) -> str:
    """Write a tiny LLaVA-Next and its processor to `folder`; returns it. The tiny LLaVA's towers and vocabulary,
    with LLaVA-Next's tiling (`NEXT_GRID`): an image's count of placeholder tokens and of pixel crops follows its
    aspect ratio, the variable resolution a padded batch of pixels must keep apart."""

    base = build_processor()
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_grid_pinpoints=NEXT_GRID,
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=base.tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=base.chat_template,
    )
    llava = model_config()
    config = LlavaNextConfig(
        vision_config=llava.vision_config,
        text_config=llava.text_config,
        image_token_id=llava.image_token_id,
        image_grid_pinpoints=NEXT_GRID,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_seq_length=4,
    )
    config.pad_token_id, config.eos_token_id = 0, 1
    model = _seeded(LlavaNextForConditionalGeneration, config, seed)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def solid_image(colour: str) -> Image.Image:
    """A solid `IMAGE_SIZE`-pixel RGB image of one of `COLOURS`."""
    return Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), COLOURS[colour])


def colours_dataset(num_prompts: int = 512, seed: int = 0) -> Dataset:
    """TRL's image layout: a conversational `prompt` (the question), an `image` column and the answer in
    `colour`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        colour = rng.choice(sorted(COLOURS))
        rows.append(
            {"prompt": [{"role": "user", "content": QUESTION}], "image": solid_image(colour), "colour": colour}
        )
    return Dataset.from_list(rows)


def colour_reward(completions: list, colour: list[str], **kwargs) -> list[float]:
    """1 for a completion that names the colour; else half the fraction of its characters that are the colour's
    initial (a graded signal a random model can climb)."""
    rewards = []
    for completion, name in zip(completions, colour, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        if name in text:
            rewards.append(1.0)
        else:
            rewards.append(0.5 * text.count(name[0]) / len(text) if text else 0.0)
    return rewards


# The tiny Qwen-VL's own tokens, after the character vocabulary: an image is written
# `<|vision_start|><|image_pad|><|vision_end|>` and its `<|image_pad|>` expanded to one token per 2 x 2 patches.
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Images are resized to multiples of 28 pixels (14-pixel patches, merged 2 x 2) between these areas, their aspect
# ratio kept: a 56 x 56 image is 4 tokens, an 84 x 28 one 3, a 28 x 56 one 2.
QWEN_PIXELS = (28 * 28, 56 * 56)


def save_tiny_qwen_vl(folder: str, seed: int = 0, version: str = "2.5") -> str:
    """Write a tiny Qwen2.5-VL (`version` "2.5") or Qwen2-VL ("2") and its processor to `folder`; returns it.

    The language model is the tiny Qwen2 (hidden 128, 2 heads of 64) with M-RoPE (sections 16 / 8 / 8 of its 32
    rotary frequencies: time, height, width); the vision tower 2 blocks of hidden 64 (2 heads of 32), 14-pixel
    patches merged 2 x 2 into one token of the language model's width. Images keep their aspect ratio
    (`QWEN_PIXELS`), so each has its own count of patches and tokens: the variable resolution whose pixels a
    rollout must keep apart, per image.

    The processor is written as files, not built: transformers 5.19's Qwen-VL processors take a video processor
    that needs torchvision; `colograd.vision.qwen.install` lets them load where torchvision is missing (colograd
    calls it before loading a Qwen-VL processor, and before the engine starts).
    """
    import json

    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if version not in ("2", "2.5"):
        raise ValueError(f"version {version!r}: '2' (Qwen2-VL) or '2.5' (Qwen2.5-VL)")
    vision_start, vision_end, image_pad, video_pad = QWEN_TOKENS
    base = len(_SPECIALS) + len(_CHARS)
    ids = {tok: base + i for i, tok in enumerate(QWEN_TOKENS)}
    roles = {"image_token": image_pad, "video_token": video_pad, "vision_start_token": vision_start,
             "vision_end_token": vision_end}  # fmt: skip
    tokenizer = _char_tokenizer(QWEN_TOKENS, r"<\|[a-z_]+\|>", roles)
    template = tokenizer.chat_template = _chat_template(vision_start + image_pad + vision_end)
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": QWEN_PIXELS[0], "longest_edge": QWEN_PIXELS[1]},
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
    )
    text = tiny.model_config().to_dict()
    for key in ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "rope_parameters"):
        text.pop(key, None)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 8, 8]}
    patches = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, num_heads=2, depth=2)
    if version == "2.5":
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision = dict(hidden_size=64, intermediate_size=128, out_hidden_size=128, window_size=56,
                      fullatt_block_indexes=[1], **patches)  # fmt: skip
        processor_class = "Qwen2_5_VLProcessor"
    else:
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision = dict(embed_dim=64, mlp_ratio=2, hidden_size=128, **patches)
        processor_class = "Qwen2VLProcessor"
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[image_pad],
        video_token_id=ids[video_pad],
        vision_start_token_id=ids[vision_start],
        vision_end_token_id=ids[vision_end],
        tie_word_embeddings=False,
    )
    config.pad_token_id, config.eos_token_id = 0, 1
    model = _seeded(model_class, config, seed)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # What `ProcessorMixin.save_pretrained` writes, the video processor's settings as transformers' own has them.
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14, "merge_size": 2,
             "temporal_patch_size": 2}  # fmt: skip
    processor = {
        "processor_class": processor_class,
        "image_processor": image_processor.to_dict(),
        "video_processor": video,
    }
    with open(os.path.join(folder, "processor_config.json"), "w") as f:
        json.dump(processor, f, indent=2)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(template)
    return folder
