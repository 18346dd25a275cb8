"""Checks of image data: one line per problem, naming the row, the field and the fix.

TRL's layout: an `images` (a list, or one image) or `image` (one) column beside a conversational `prompt`, read in
TRL 1.16's order (`colograd.vision.core.row_images`); the images go into the first user message as `{"type": "image"}`
parts (`trl.data_utils.prepare_multimodal_messages`), or fill the image parts the messages already have.

One function checks a row (`check_row`); preflight calls it on a bounded sample of the dataset (`sample_rows`: the
first rows and a seeded draw of the rest, or a stream's first rows), and the trainer on every row of every rollout,
before any work on it, so a bad row past the sample stops training at its rollout with the message preflight would
have given. What preflight alone checks: the model takes images, the processor matches the model
(`check_processor`), and the longest expanded prompt of the sample fits `max_prompt_length`.
"""

import os
import random
from typing import Any

import datasets
from PIL import Image
from trl.data_utils import is_conversational, prepare_multimodal_messages

from colograd.data.core import conversations_fix
from colograd.data.streaming import PEEK_ROWS, peek, read_row
from colograd.errors import ConfigError
from colograd.vision.core import (
    IMAGE_COLUMNS,
    RowImages,
    image_field,
    image_prompts,
    is_processor,
    is_vision_language,
    row_images,
)
from colograd.vision.images import to_rgb

# Rows of an in-memory dataset preflight checks: the first half of them, and a seeded draw of the rest (4 ms per
# decoded 640x480 JPEG: about a second, where every row of 100k took minutes).
SAMPLED_ROWS = PEEK_ROWS
# LLaVA-style text: the image placeholder written into the prompt. TRL 1.16 adds an image part beside it, so the
# template holds two placeholders for one image (the LLaVA processor then raises a bare StopIteration).
LLAVA_PLACEHOLDER = "<image>"
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff")


def dataset_columns(dataset: Any, name: str = "train_dataset") -> list[str]:
    """A dataset's columns: its own where known, else (a stream built `from_generator`) those of its first row."""
    names = getattr(dataset, "column_names", None)
    if names is not None:
        return list(names)
    if isinstance(dataset, datasets.IterableDataset):
        return list(next(iter(peek(dataset, 1, name)), {}))
    return []


def image_columns(dataset: Any, name: str = "train_dataset") -> list[str]:
    """The image columns (TRL's names, in the order TRL reads them) of a dataset or stream, [] where it has none."""
    columns = dataset_columns(dataset, name)
    return [c for c in IMAGE_COLUMNS if c in columns]


def sample_rows(dataset: Any, name: str = "train_dataset") -> list[tuple[int, dict]]:
    """The rows preflight checks, as (index, row): of an in-memory dataset the first `SAMPLED_ROWS // 2` and a
    seeded draw of the rest, `SAMPLED_ROWS` in all; of a stream its first `PEEK_ROWS` (read afresh: the stream
    training reads is not advanced).

    Raises:
        ConfigError: a sampled row cannot be read (datasets decodes an Image column as a row is read).
    """
    if not hasattr(dataset, "__len__"):
        return list(enumerate(peek(dataset, PEEK_ROWS, name)))
    size = len(dataset)
    first = list(range(min(size, SAMPLED_ROWS // 2)))
    rest = range(len(first), size)
    indices = first + sorted(random.Random(0).sample(rest, min(len(rest), SAMPLED_ROWS - len(first))))
    return [(i, read_row(dataset, i, name)) for i in indices]


def most_images(dataset: Any, columns: list[str], rows: list[tuple[int, dict]]) -> int:
    """The most images of a row: of an in-memory dataset read from its Arrow column without decoding an image (over
    the whole table, an upper bound where the dataset is a selection of it), else over the rows read."""
    table = getattr(dataset, "data", None)
    if "images" in columns and table is not None:
        import pyarrow as pa
        import pyarrow.compute as pc

        column = table.column("images")
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            return int(pc.max(pc.list_value_length(column)).as_py() or 0)
        return 1  # one image per row (TRL's `images` of single images)
    if columns == ["image"] and table is not None:
        return 1
    return max((len(row_images(row)) for _, row in rows), default=0)


def check_image_data(
    model: Any,
    processing_class: Any,
    dataset: Any,
    template_kwargs: dict | None = None,
    name: str = "train_dataset",
    max_prompt_length: int | None = None,
) -> tuple[int, int | None]:
    """Check a dataset's (or a stream's) images against the model and processor, on a sample of its rows.

    Args:
        model: the policy (bare, or under PEFT).
        processing_class: the processor (or tokenizer) the trainer was given.
        dataset: a `datasets.Dataset` or `datasets.IterableDataset` (columns known, or discovered from its first
            rows).
        template_kwargs: the chat template's extra arguments (`chat_template_kwargs`).
        name: the dataset's name in messages.
        max_prompt_length: a prompt longer than this with its images expanded is refused (image prompts are not
            cut).

    Returns:
        (the most images of a row, at least 1 where the dataset has an image column; the most tokens of a sampled
        prompt with its images expanded); (0, None) for a dataset without an image column.

    Raises:
        ConfigError: an image column on a text-only model; a tokenizer where a processor is needed; a processor
            that does not match the model; a sampled row that `check_row` refuses, or whose expanded prompt is
            longer than `max_prompt_length`.
    """
    if dataset is None or (not hasattr(dataset, "__len__") and not isinstance(dataset, datasets.IterableDataset)):
        return 0, None  # not a dataset colograd reads (refused by the stream checks)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    columns = image_columns(dataset, name)
    vision = is_vision_language(base)
    if columns and not vision:
        raise ConfigError(
            f"{name} has an {columns[0]!r} column but {type(base).__name__} takes no images: use a "
            "vision-language model (e.g. a LLaVA or Qwen2.5-VL), or remove the column."
        )
    if vision and is_processor(processing_class):
        check_processor(base, processing_class)
    if not vision:
        return 0, None
    if columns and not is_processor(processing_class):
        raise ConfigError(
            f"processing_class is a {type(processing_class).__name__}; image rows need the model's processor: pass "
            "AutoProcessor.from_pretrained(...) or leave processing_class unset."
        )
    rows = sample_rows(dataset, name)
    images = [check_row(row, f"{name} row {i}", processing_class, image_run=bool(columns)) for i, row in rows]
    if not columns:
        return 0, None
    most = max(1, most_images(dataset, columns, rows))
    if not rows:
        return most, None
    _, expanded, _ = image_prompts(processing_class, [r["prompt"] for _, r in rows], images, template_kwargs)
    if max_prompt_length is not None:
        check_prompt_lengths(expanded, [f"{name} row {i}" for i, _ in rows], max_prompt_length, "max_prompt_length")
    return most, max(map(len, expanded))


def check_row(
    row: dict, where: str, processing_class: Any, image_run: bool = True, most_images: int | None = None
) -> list[Any]:
    """One row of a vision-language run, as preflight checks a sampled row and each rollout every row it reads.

    Args:
        row: the dataset row.
        where: how messages name it ("train_dataset row 300").
        processing_class: the processor (its image token); a tokenizer for a text-only run.
        image_run: the dataset has an image column (its prompts must then be conversational).
        most_images: the most images the engine was started for (None: not checked).

    Returns:
        The row's images, each as 8-bit RGB with its picture (`colograd.vision.images.to_rgb`), named for the
        processor's messages (`RowImages`).

    Raises:
        ConfigError: an image that is not a PIL image (its field named, with the fix), or of a mode PIL cannot
            convert; a LLaVA-Instruct / ShareGPT row (`conversations`, no `prompt`); image rows whose prompt is
            text; an image placeholder written in the prompt's text (LLaVA-style); images that do not fill the
            prompt's image parts (an image part whose image is None); more images than the engine takes.
    """
    if "prompt" not in row and "conversations" in row:
        raise ConfigError(f"{where}: {conversations_fix(row)}")
    field = image_field(row)
    images = row_images(row)
    names = [field if field == "image" else f"{field}[{k}]" for k in range(len(images))]
    for image, name in zip(images, names, strict=True):
        check_image(image, where, name)
    images = RowImages([to_rgb(image, f"{where}: {name!r}") for image, name in zip(images, names, strict=True)], where)
    prompt = row.get("prompt")
    if image_run and not is_conversational({"prompt": prompt}):
        raise ConfigError(
            f"{where}: the prompt is text, but image rows need conversational prompts (a list of "
            '{"role", "content"} messages) so that the chat template places the images.'
        )
    _check_placeholder_text(prompt, where, processing_class)
    if image_run:
        parts = _image_parts(prompt)
        try:
            prepare_multimodal_messages(prompt, images)
        except ValueError as err:
            if "does not match" not in str(err):  # not the count: a message TRL cannot read (e.g. its role)
                raise ConfigError(f"{where}: the prompt's messages cannot take images ({_short(err)}).") from None
            given = f"{len(images)} image{'s' * (len(images) != 1)}"
            if not images:
                given += f" ({field!r} is {'empty' if row.get(field) is not None else 'None'})"
            raise ConfigError(
                f"{where}: {given} for the prompt's {parts} image part{'s' * (parts != 1)}; give one image per "
                '{"type": "image"} part, or plain-text messages (the images then go first).'
            ) from None
    if most_images is not None and len(images) > most_images:
        raise ConfigError(
            f"{where}: {len(images)} images, more than the {most_images} per prompt the engine was started for (the "
            "most of a row preflight read); put a row with the most images among a stream's first "
            f"{PEEK_ROWS} rows."
        )
    return images


def check_prompt_lengths(expanded: list[list[int]], where: list[str], limit: int, setting: str) -> None:
    """Image prompts are never cut (a cut could split an image): the first prompt longer than `limit` tokens with
    its images expanded is refused, naming its row and `setting`, the limit."""
    for ids, name in zip(expanded, where, strict=True):
        if len(ids) > limit:
            raise ConfigError(
                f"{name}: its prompt is {len(ids)} tokens with its images expanded, longer than the {limit} a "
                f"rollout keeps ({setting}); image prompts are not cut (that would cut an image): raise "
                "max_prompt_length, or use smaller images."
            )


def check_image(value: Any, where: str, field: str = "image") -> None:
    """One image value: a PIL image. Anything else is named for what it is, with the fix: a path (missing, not an
    image, or not yet decoded), text, an undecoded `datasets.Image` value, an array or tensor, a list, None."""
    if isinstance(value, Image.Image):
        return
    what = f"{where}: {field!r}"
    if value is None:
        raise ConfigError(f"{what} is None; drop it from the list (an empty list is a text-only row).")
    if isinstance(value, str):
        _check_image_string(value, what, field)
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        raise ConfigError(
            f"{what} is an undecoded image ({{'bytes', 'path'}}); decode the column: "
            f"dataset.cast_column({field.split('[')[0]!r}, datasets.Image())."
        )
    kind = type(value).__module__.split(".")[0]
    if kind in ("numpy", "torch", "jax", "tensorflow"):
        shape = "x".join(map(str, getattr(value, "shape", ())))
        raise ConfigError(
            f"{what} is a {kind} {type(value).__name__} ({shape}); images must be PIL images: convert it "
            "(PIL.Image.fromarray(array), an [H, W, 3] uint8 array), or store the column as datasets.Image()."
        )
    if isinstance(value, list | tuple):
        raise ConfigError(
            f"{what} is a {type(value).__name__}, not a PIL image (pixel values?); one image per row goes in an "
            "'image' column, several in an 'images' column, each a PIL image."
        )
    raise ConfigError(f"{what} is a {type(value).__name__}, not a PIL image.")


def _check_image_string(value: str, what: str, field: str) -> None:
    """Refuse an image given as a string, named for what it is."""
    if os.path.isfile(value):
        try:
            with Image.open(value) as image:
                image.verify()
        except Exception:
            raise ConfigError(f"{what}: {value!r} is not an image file PIL can read.") from None
        raise ConfigError(
            f"{what} is a path ({value!r}); cast the column to images first: "
            f"dataset.cast_column({field.split('[')[0]!r}, datasets.Image())."
        )
    if os.sep in value or os.path.splitext(value)[1].lower() in _IMAGE_SUFFIXES:
        raise ConfigError(f"{what}: the image path {value!r} does not exist.")
    raise ConfigError(f"{what} is text ({value[:40]!r}), not an image.")


def _check_placeholder_text(prompt: Any, where: str, processing_class: Any) -> None:
    """Refuse an image placeholder written in the prompt's text (LLaVA-style `<image>`, or the processor's own
    token): TRL 1.16 does not read it, and adds an image part of its own, so the template would hold two
    placeholders for one image."""
    tokens = {LLAVA_PLACEHOLDER, getattr(processing_class, "image_token", None) or LLAVA_PLACEHOLDER}
    for text in _texts(prompt):
        for token in tokens:
            if token in text:
                raise ConfigError(
                    f"{where}: the prompt's text holds the image placeholder {token!r} (LLaVA-style); as in TRL 1.16, "
                    "images are placed by the 'image' / 'images' column: remove it from the text (the images then go "
                    'before the first user message\'s text), or write {"type": "image"} parts where they go.'
                )


def _texts(prompt: Any) -> list[str]:
    """The text of a prompt: the string, or each message's string content and text parts."""
    if isinstance(prompt, str):
        return [prompt]
    texts = []
    for message in prompt if isinstance(prompt, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return texts


def _image_parts(prompt: Any) -> int:
    """The `{"type": "image"}` parts of a conversational prompt waiting for an image (TRL's count)."""
    return sum(
        1
        for message in prompt
        if isinstance(message.get("content"), list) and message.get("role") != "tool"
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image" and "image" not in part
    )


# What a Qwen-VL's image processor and vision config must agree on besides the patch size: (the vision config's
# name, the image processor's, the message's words).
_MERGE_SIZES = (
    ("spatial_merge_size", "merge_size", "merge size (patches per token side)"),
    ("temporal_patch_size", "temporal_patch_size", "temporal patch size"),
)


def check_processor(model: Any, processor: Any) -> None:
    """The processor must expand images as the model reads them: its image token id, its patch size, (for a
    Qwen-VL) its merge and temporal patch sizes, and (for a fixed-resolution LLaVA) its placeholders per image
    against the model's config. The engine expands with the model's own processor, and the model matches its
    features to the placeholders: a processor of another model fails deep in vLLM or transformers, naming neither.
    Where the count of placeholders varies with the image (LLaVA-Next, Qwen-VL), the count itself is left to the
    expansion check at every rollout (`colograd.vision.core.check_expansion`).

    Raises:
        ConfigError: a disagreement, naming the processor and the model.
    """
    config = model.config
    found = []
    model_token = _first(config, "image_token_id", "image_token_index")
    token = getattr(processor, "image_token_id", None)
    if model_token is not None and token is not None and model_token != token:
        found.append(f"its image token id is {token} where the model's is {model_token}")
    vision = getattr(config, "vision_config", None)
    model_patch = getattr(vision, "patch_size", None)
    patch = _first(processor, "patch_size") or _first(getattr(processor, "image_processor", None), "patch_size")
    if model_patch is not None and patch is not None and model_patch != patch:
        found.append(f"its patch size is {patch} where the model's is {model_patch}")
    # Qwen-VL: patches merged n x n into one token, and frames in pairs (a still is repeated).
    image_processor = getattr(processor, "image_processor", None)
    for model_name, name, what in _MERGE_SIZES:
        ours, theirs = getattr(vision, model_name, None), getattr(image_processor, name, None)
        if ours is not None and theirs is not None and ours != theirs:
            found.append(f"its {what} is {theirs} where the model's is {ours}")
    expected = _llava_image_tokens(config)
    if not found and expected is not None and token is not None:
        size = vision.image_size
        out = processor(text=[processor.image_token], images=[Image.new("RGB", (size, size))], return_tensors="pt")
        given = out["input_ids"][0].tolist().count(token)
        if given != expected:
            found.append(f"it expands an image to {given} placeholders where the model reads {expected} features")
    if found:
        name = getattr(getattr(processor, "tokenizer", processor), "name_or_path", "") or "built in memory"
        model_name = getattr(config, "_name_or_path", "") or "built in memory"
        raise ConfigError(
            f"processing_class {type(processor).__name__} ({name}) does not match the model "
            f"{type(model).__name__} ({model_name}): {'; '.join(found)}; pass the model's own processor "
            "(AutoProcessor.from_pretrained of the model), or leave processing_class unset."
        )


def _llava_image_tokens(config: Any) -> int | None:
    """The image features a fixed-resolution LLaVA reads per image: its vision tower's patches, with CLIP's class
    feature, less the first feature under the 'default' selection. None for other models (their counts vary with
    the image: the engine's expansion is checked at every rollout instead)."""
    vision = getattr(config, "vision_config", None)
    if getattr(config, "model_type", None) != "llava" or not hasattr(vision, "image_size"):
        return None
    features = (vision.image_size // vision.patch_size) ** 2
    if vision.model_type == "clip_vision_model":
        features += 1  # the class embedding
    elif vision.model_type != "siglip_vision_model":
        return None
    return features - (getattr(config, "vision_feature_select_strategy", "default") == "default")


def _first(obj: Any, *names: str) -> Any:
    """The first of `names` that `obj` has and is not None."""
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


def _short(err: Exception) -> str:
    return str(err).splitlines()[0][:160] if str(err) else type(err).__name__
