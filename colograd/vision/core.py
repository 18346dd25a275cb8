"""Vision-language models in the engine: what vLLM needs to serve one, and how its weights are named there.

Three things differ from a text model:

- vLLM's multimodal model files (llava, qwen2_vl, qwen2_5_vl, ...) import transformers' pixtral image processor,
  which needs torchvision; where torchvision is missing (the CPU torch build has none that matches), vLLM's model
  inspection fails ("failed to be inspected"). `serve_without_torchvision` hands vLLM transformers' PIL pixtral
  processor under that name and registers the architecture in this process, so the inspection vLLM runs in a
  subprocess (and caches under ``~/.cache/vllm/modelinfos``) is not needed.
- transformers 5 keeps a LLaVA's CLIP / SigLIP vision tower flat (``model.vision_tower.embeddings...``) where
  vLLM's tower is wrapped (``vision_tower.vision_model.embeddings...``): `engine_weight_name` renames.
- the engine gets prompts with one placeholder per image, not expanded (`multimodal_prompt`): vLLM's processor
  expands them itself, and ids expanded already are expanded again, silently.
"""

import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# transformers' modules that need torchvision, and their PIL twins with the same functions.
_PIL_TWINS = {
    "transformers.models.pixtral.image_processing_pixtral": "transformers.models.pixtral.image_processing_pil_pixtral",
    # vLLM's qwen2_vl imports `smart_resize` from here.
    "transformers.models.qwen2_vl.image_processing_qwen2_vl": (
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
    ),
}
# The vLLM module of each architecture colograd has run whose module imports a torchvision processor (docs/vlm.md).
_VLLM_MODULES = {
    "LlavaForConditionalGeneration": "vllm.model_executor.models.llava",
    "LlavaNextForConditionalGeneration": "vllm.model_executor.models.llava_next",
    "Qwen2VLForConditionalGeneration": "vllm.model_executor.models.qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "vllm.model_executor.models.qwen2_5_vl",
    # Qwen3.5 (hybrid; text-only and vision-language) imports Qwen3-VL's module, which imports Qwen2-VL's processor.
    "Qwen3_5ForCausalLM": "vllm.model_executor.models.qwen3_5",
    "Qwen3_5MoeForCausalLM": "vllm.model_executor.models.qwen3_5",
    "Qwen3_5ForConditionalGeneration": "vllm.model_executor.models.qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "vllm.model_executor.models.qwen3_5",
}
# Architectures whose processor takes a torchvision-only video processor (`colograd.vision.qwen`).
_STILLS_ONLY = (
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
# Vision towers that transformers 5 keeps flat and vLLM wraps in `vision_model`.
_FLAT_TOWERS = ("CLIPVisionTransformer", "SiglipVisionTransformer", "CLIPVisionModel", "SiglipVisionModel")


def is_vision_language(model: nn.Module) -> bool:
    """Whether `model` (bare, or the base model under PEFT) takes images: its config has a vision part."""
    return getattr(model.config, "vision_config", None) is not None


def engine_arguments(images_per_prompt: int) -> dict[str, Any]:
    """A vision-language engine's `vllm.LLM` arguments, the same for every architecture.

    - The most images a prompt may hold, and no video (colograd's data holds none): vLLM sizes its encoder cache and
      profiles its encoder at start-up for the most items of each modality a prompt may hold, 999 of one it is not
      told.
    - Images normalised on the host, by the processor, as the trainer's are (`mm_device_do_normalize=False`). Where
      vLLM normalises them in the model instead (Qwen-VL, Qwen3-VL, Mistral-3, GLM-4.1V, ...), its mean / std are
      buffers that no checkpoint weight writes: vLLM 0.32 registers them persistent and its dummy start
      (`load_format="dummy"`, the trainer's weights loaded after) randomises them, so the engine would see other
      image features than the trainer's, silently.
    """
    return {"limit_mm_per_prompt": {"image": max(1, images_per_prompt), "video": 0}, "mm_device_do_normalize": False}


def text_tokenizer(processing_class: Any) -> Any:
    """The tokenizer of a processor (a multimodal `processing_class`), or `processing_class` itself."""
    return processing_class.tokenizer if is_processor(processing_class) else processing_class


def is_processor(processing_class: Any) -> bool:
    """Whether `processing_class` is a multimodal processor (a tokenizer and an image processor) not a tokenizer."""
    from transformers import ProcessorMixin

    return isinstance(processing_class, ProcessorMixin)


def serve_without_torchvision(architecture: str) -> None:
    """Let vLLM serve `architecture` where torchvision cannot be imported.

    The torchvision-only image processor modules are served by their PIL twins (the functions vLLM imports from them
    are the same), Qwen-VL's video processor by a stills-only stand-in (`colograd.vision.qwen`), and the
    architecture's vLLM class is registered in this process, so that vLLM inspects it here, where the twins are in
    place, rather than in a fresh interpreter. Where torchvision imports, nothing is needed. (What every
    vision-language engine is built with, wherever it runs, is `engine_arguments`: images
    normalised on the host, no video.)
    """
    if architecture not in _VLLM_MODULES or importlib.util.find_spec("torchvision") is not None:
        return
    for name, twin in _PIL_TWINS.items():
        if name not in sys.modules:
            sys.modules[name] = importlib.import_module(twin)
    if architecture in _STILLS_ONLY:
        from colograd.vision import qwen

        qwen.install()  # vLLM builds the Qwen-VL processor from the model's folder: its video processor
    from vllm import ModelRegistry

    model_class = getattr(importlib.import_module(_VLLM_MODULES[architecture]), architecture)
    ModelRegistry.register_model(architecture, model_class)


def engine_weight_name(model: nn.Module) -> Callable[[str], str]:
    """How the engine names a checkpoint weight of `model`: the identity for text models; for a LLaVA whose vision
    tower transformers keeps flat, ``model.vision_tower.X`` becomes ``model.vision_tower.vision_model.X`` (vLLM's
    own checkpoint mapping then does the rest)."""
    inner = getattr(model, "model", None)
    tower = getattr(inner, "vision_tower", None)
    if tower is None or type(tower).__name__ not in _FLAT_TOWERS or hasattr(tower, "vision_model"):
        return lambda name: name
    prefix = "model.vision_tower."
    return lambda name: prefix + "vision_model." + name.removeprefix(prefix) if name.startswith(prefix) else name


def multimodal_prompt(token_ids: list[int], images: list[Any] | None) -> dict[str, Any]:
    """One engine prompt: `token_ids` with one placeholder per image (not expanded), and the images as vLLM's
    `multi_modal_data`, which vLLM's processor expands once."""
    if not images:
        return {"prompt_token_ids": token_ids}
    return {"prompt_token_ids": token_ids, "multi_modal_data": {"image": images if len(images) > 1 else images[0]}}


# The dataset columns that hold a row's images, TRL's names in TRL 1.16's order: a row with an `images` column is
# read from it (a list, or one image), else from `image` (one image, or None for a text-only row).
IMAGE_COLUMNS = ("images", "image")
# Multimodal architectures whose text positions the model computes itself from the images (M-RoPE): they are not
# given 1-D position ids.
_OWN_POSITIONS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# Prefix of the rollout tensors that hold a processor's outputs, one padded block per completion.
MM_PREFIX = "mm_"


# A processor's outputs that are per token of the prompt, not per image: the rollout's own ids and mask stand for
# them (`mm_token_type_ids`, which Qwen-VL's M-RoPE reads, is rebuilt from the ids: `forward_images`).
_PER_TOKEN = ("input_ids", "attention_mask", "mm_token_type_ids")


def image_field(row: dict[str, Any]) -> str:
    """The column a row's images are read from: `images` where the row has it (as TRL 1.16 reads it first, even
    beside an `image` column), else `image`."""
    return "images" if "images" in row else "image"


def row_images(row: dict[str, Any]) -> list[Any]:
    """The images of one dataset row, [] for a text-only row, read as TRL 1.16 reads them (`image_field`): an
    `images` value that is not a list is one image (a column of single images), a None one no image; an `image`
    value is one image whatever it is (`check_image` refuses a list there)."""
    field = image_field(row)
    value = row.get(field)
    if value is None:
        return []
    return list(value) if field == "images" and isinstance(value, list | tuple) else [value]


class RowImages(list):
    """One row's images as `colograd.vision.checks.check_row` returns them (converted for the processor), a list
    that also carries the row's name (`where`, "train_dataset row 300") for the processor's errors."""

    def __init__(self, images: list[Any], where: str) -> None:
        super().__init__(images)
        self.where = where


def image_prompts(
    processor: Any, prompts: list, images: list[list[Any]], template_kwargs: dict[str, Any] | None = None
) -> tuple[list[list[int]], list[list[int]], list[dict[str, torch.Tensor]]]:
    """Template and process conversational prompts with their images, one row at a time.

    Args:
        processor: the model's processor (tokenizer, image processor, chat template).
        prompts: each row's messages.
        images: each row's images ([] for a text-only row); a row's `RowImages` name it in the processor's errors.

    Returns:
        engine_ids: each prompt's ids with one placeholder per image, for the engine (it expands them itself).
        expanded_ids: each prompt's ids as the processor expands them, for the trainer's forward.
        pixels: each row's processor outputs besides the ids (`pixel_values` [images, C, H, W] or patches,
            `image_grid_thw`, `image_sizes`, ...), first dimension per image or patch; {} for a text-only row.

    Raises:
        ConfigError: the processor refuses a row's images (e.g. Qwen-VL's, an aspect ratio over 200:1), naming the
            row, its images' sizes and the fix.
    """
    from trl.data_utils import prepare_multimodal_messages

    engine_ids, expanded_ids, pixels = [], [], []
    for messages, imgs in zip(prompts, images, strict=True):
        text = processor.apply_chat_template(
            prepare_multimodal_messages(messages, imgs),
            add_generation_prompt=True,
            tokenize=False,
            **(template_kwargs or {}),
        )
        engine_ids.append(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not imgs:
            expanded_ids.append(engine_ids[-1])
            pixels.append({})
            continue
        try:
            out = processor(text=[text], images=imgs, add_special_tokens=False, return_tensors="pt")
        except Exception as err:  # the processor's own error names neither the row nor the image
            where = imgs.where if isinstance(imgs, RowImages) else f"the rollout's prompt {len(pixels)}"
            raise processor_refusal(err, imgs, where) from err
        expanded_ids.append(out["input_ids"][0].tolist())
        pixels.append({k: v for k, v in out.items() if k not in _PER_TOKEN})
    return engine_ids, expanded_ids, pixels


def processor_refusal(err: Exception, images: list[Any], where: str) -> Exception:
    """The processor's error on a row's images, as one line naming the row, each image's size, and the fix."""
    from colograd.errors import ConfigError

    sizes = ", ".join(f"{image.width}x{image.height}" for image in images)
    message = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    fix = "fix or drop the row (dataset.filter)"
    if "aspect ratio" in message:
        fix = "pad or crop the image to an aspect ratio the processor takes (e.g. PIL.ImageOps.pad), or drop the row"
    return ConfigError(
        f"{where}: the processor refuses its image{'s' * (len(images) != 1)} ({sizes}): {message}; {fix}."
    )


def rotate_prompts(
    generate: Callable[[list[list[int]], list[list[Any]] | None, Callable | None], Any],
    prompt_ids: list[list[int]],
    images: list[list[Any]] | None,
    on_group: Callable[[int, list[list[int]]], None] | None,
    shift: int,
    num_generations: int,
) -> Any:
    """One engine call with the prompts rotated left by `shift` (prompt `shift` first, where the engine asks the
    sampling-gap metric's log-probs), its `Rollout` put back in the prompts' own order.

    Args:
        generate: the engine call, `generate(prompt_ids, images, on_group)`, returning a `Rollout` of
            `num_generations` completions per prompt, groups contiguous.
        prompt_ids, images: each prompt's ids and images (None: no images).
        on_group: called as `on_group(i, completions)` with the prompt's own index i; None.
        shift: the prompt to put first; 0 calls `generate` as given.
    """
    if not shift:
        return generate(prompt_ids, images, on_group)
    n, g = len(prompt_ids), num_generations
    order = [(shift + j) % n for j in range(n)]  # the prompt at each place of the call
    report = None if on_group is None else lambda j, completions: on_group(order[j], completions)
    rollout = generate([prompt_ids[i] for i in order], None if images is None else [images[i] for i in order], report)
    place = [(i - shift) % n for i in range(n)]  # each prompt's place in the call

    def per_completion(values: list | None) -> list | None:
        return None if values is None else [values[place[i] * g + c] for i in range(n) for c in range(g)]

    def per_prompt(values: list | None) -> list | None:
        return None if values is None else [values[place[i]] for i in range(n)]

    return dataclasses.replace(
        rollout,
        completion_ids=per_completion(rollout.completion_ids),
        logps=per_completion(rollout.logps),
        truncated=per_completion(rollout.truncated),
        tool_mask=per_completion(rollout.tool_mask),
        prompt_ids=per_completion(rollout.prompt_ids),
        routed=per_completion(rollout.routed),
        asked=per_completion(rollout.asked),
        engine_prompt_ids=per_prompt(rollout.engine_prompt_ids),
    )


def check_expansion(engine_ids: list[list[int]], expanded_ids: list[list[int]]) -> None:
    """The engine's prompts, as its own processor expanded them, must be the trainer's (each image's placeholders
    once, the same count): else the engine sampled from other inputs than the ones trained on."""
    for i, (engine, trainer) in enumerate(zip(engine_ids, expanded_ids, strict=True)):
        if engine != trainer:
            raise RuntimeError(
                f"prompt {i}: the engine expanded its image placeholders to {len(engine)} tokens where the processor "
                f"gives {len(trainer)}: the engine must get one placeholder per image, unexpanded (multimodal_prompt)."
            )


def pad_pixels(pixels: list[dict[str, torch.Tensor]], num_generations: int) -> dict[str, torch.Tensor]:
    """Each completion's processor outputs as rollout tensors that split by rows like the others.

    Row i's value of key k (first dimension: its images or patches, a count that varies) becomes row i of
    ``mm_k`` [N, most, ...], zero-padded, with its count in ``mm_k_len`` [N]; each prompt's row repeats for its
    `num_generations` completions. Empty when no row has an image.

    The other dimensions may differ too: an image's count of crops follows its aspect ratio where the processor
    tiles images (LLaVA-Next: pixel values [images, crops, C, H, W]). They are zero-padded to the largest, as the
    processor itself pads a batch of such images; the model reads each image's real crops from its `image_sizes`.
    """
    keys = sorted({k for row in pixels for k in row})
    out = {}
    for key in keys:
        rows = [row.get(key) for row in pixels for _ in range(num_generations)]
        like = next(r for r in rows if r is not None)
        shape = [max(r.shape[d] if r is not None else 0 for r in rows) for d in range(like.dim())]
        block = like.new_zeros((len(rows), *shape))
        for i, r in enumerate(rows):
            if r is not None:
                block[(i, *(slice(0, n) for n in r.shape))] = r
        out[MM_PREFIX + key] = block
        out[MM_PREFIX + key + "_len"] = torch.tensor([len(r) if r is not None else 0 for r in rows])
    return out


def forward_images(batch: dict[str, torch.Tensor], model_config: Any = None) -> dict[str, torch.Tensor]:
    """The processor outputs of a slice of rollout rows (`pad_pixels`' tensors), rebuilt as the model takes them:
    each key's rows' real entries concatenated in row order, the order of their placeholders in the padded
    input ids. Empty when the slice has no image.

    For a model that computes its own M-RoPE positions (`model_config` of a Qwen2-VL / Qwen2.5-VL), also
    `mm_token_type_ids` [N, L]: 1 at the batch's image placeholders, 0 elsewhere (padding included: the
    attention mask leaves it out; a video placeholder is never sampled, `placeholder_ids`), which transformers
    5.19 reads to place the images in the positions; without it the model gives every token a 1-D position,
    silently, where vLLM gives image tokens their height and width."""
    out = {}
    for name, block in batch.items():
        if not name.startswith(MM_PREFIX) or name.endswith("_len"):
            continue
        lengths = batch[name + "_len"].tolist()
        if sum(lengths):
            out[name.removeprefix(MM_PREFIX)] = torch.cat([block[i, :n] for i, n in enumerate(lengths)])
    if out and model_config is not None and not takes_position_ids(model_config):
        out["mm_token_type_ids"] = (batch["input_ids"] == model_config.image_token_id).int()
    return out


def takes_position_ids(model_config: Any) -> bool:
    """Whether the model is given the rollout's 1-D position ids (not a model that computes M-RoPE positions)."""
    return getattr(model_config, "model_type", None) not in _OWN_POSITIONS


def placeholder_ids(processing_class: Any) -> list[int]:
    """The token ids that stand for images, which a completion must never hold (the model would look for an image
    there): the processor's image token, and its video token where it has one (Qwen-VL), none for a tokenizer."""
    if not is_processor(processing_class):
        return []
    ids = [getattr(processing_class, name, None) for name in ("image_token_id", "video_token_id")]
    return [token_id for token_id in ids if token_id is not None]


def freeze_vision_tower(model: nn.Module) -> int:
    """Stop training the image encoder of `model` (bare or PEFT-wrapped): `requires_grad` off on its parameters.

    Returns:
        The number of parameters frozen.

    Raises:
        ConfigError: the model has no image encoder colograd knows (a LLaVA's `vision_tower`, a Qwen-VL's `visual`).
    """
    from colograd.errors import ConfigError

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", base)
    tower = getattr(inner, "vision_tower", None) or getattr(inner, "visual", None)
    if tower is None:
        raise ConfigError(
            f"freeze_vision_tower: {type(base).__name__} has no vision tower (vision_tower / visual); set it to false."
        )
    frozen = 0
    for param in tower.parameters():
        param.requires_grad_(False)
        frozen += param.numel()
    return frozen


def load_pretrained(source: Any, text_class: Any, **kwargs: Any) -> Any:
    """Load a model (`text_class` is `AutoModelForCausalLM`) or its processing class (`AutoTokenizer`) from a hub id
    or folder, or for a model already loaded from its name: for a vision-language model (its config has a vision
    part) the image-text model, or the processor (AutoProcessor), instead of the text class."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

    from colograd.vision import qwen

    name = source if isinstance(source, str) else source.config._name_or_path
    config = source.config if not isinstance(source, str) else AutoConfig.from_pretrained(name)
    if getattr(config, "vision_config", None) is None:
        return text_class.from_pretrained(name, **kwargs)
    if text_class is not AutoModelForCausalLM and config.model_type in qwen.MODEL_TYPES:
        qwen.install()  # its processor takes a video processor that needs torchvision: a stills-only one stands in
    return (AutoModelForImageTextToText if text_class is AutoModelForCausalLM else AutoProcessor).from_pretrained(
        name, **kwargs
    )
