"""Checks of image data before start-up: one line per problem, naming the row and the fix.

TRL's layout: an `image` (one) or `images` (a list) column beside a conversational `prompt`; the images go into the
first user message as `{"type": "image"}` parts (`trl.data_utils.prepare_multimodal_messages`), or fill the image
parts the messages already have.
"""

import os
from typing import Any

from PIL import Image
from trl.data_utils import is_conversational, prepare_multimodal_messages

from colograd.errors import ConfigError
from colograd.vision import IMAGE_COLUMNS, image_prompts, is_processor, is_vision_language, row_images

# Rows processed (images expanded) to measure the longest prompt the engine gets.
_MEASURED_ROWS = 256


def image_columns(dataset: Any) -> list[str]:
    """The image columns (TRL's names) of a dataset, [] where it has none or its columns are unknown (a stream)."""
    names = getattr(dataset, "column_names", None) or []
    return [c for c in IMAGE_COLUMNS if c in names]


def check_image_data(
    model: Any, processing_class: Any, dataset: Any, template_kwargs: dict | None = None, name: str = "train_dataset"
) -> tuple:
    """Check a dataset's images against the model and processor.

    Returns:
        (the most images of a row, the most tokens of a prompt with its images expanded, over the first rows);
        (0, None) for a text-only dataset.

    Raises:
        ConfigError: an image column on a text-only model, or a tokenizer where a processor is needed; a row whose
            image is not an image (a path that does not exist, a file that is not an image, text); a row with more
            images than its messages' image parts; a row whose prompt is not conversational.
    """
    columns = image_columns(dataset)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not columns:
        return 0, None
    if not is_vision_language(base):
        raise ConfigError(
            f"{name} has an {columns[0]!r} column but {type(base).__name__} takes no images: use a "
            "vision-language model (e.g. a LLaVA or Qwen2.5-VL), or remove the column."
        )
    if not is_processor(processing_class):
        raise ConfigError(
            f"processing_class is a {type(processing_class).__name__}; image rows need the model's processor: pass "
            "AutoProcessor.from_pretrained(...) or leave processing_class unset."
        )
    most = 0
    for i in range(len(dataset)):
        try:
            row = dataset[i]
        except Exception as err:  # datasets decodes an Image column on access
            raise ConfigError(f"{name} row {i}: its image cannot be read ({_short(err)}).") from None
        images = row_images(row)
        for image in images:
            check_image(image, i, name)
        if images and not is_conversational({"prompt": row["prompt"]}):
            raise ConfigError(
                f"{name} row {i}: the prompt is text, but image rows need conversational prompts (a list of "
                '{"role", "content"} messages) so that the chat template places the images.'
            )
        if images:
            try:
                prepare_multimodal_messages(row["prompt"], images)
            except ValueError as err:
                raise ConfigError(
                    f"{name} row {i}: {len(images)} images for the prompt's image parts ({_short(err)}); give "
                    'one {"type": "image"} part per image, or plain-text messages (the images then go first).'
                ) from None
        most = max(most, len(images))
    rows = [dataset[i] for i in range(min(len(dataset), _MEASURED_ROWS))]
    _, expanded, _ = image_prompts(
        processing_class, [r["prompt"] for r in rows], [row_images(r) for r in rows], template_kwargs
    )
    return most, max(map(len, expanded))


def check_image(value: Any, row: int, name: str = "train_dataset") -> None:
    """One image value: a PIL image; a string is named for what it is (a missing path, a file that is not an
    image, text)."""
    if isinstance(value, Image.Image):
        return
    if isinstance(value, str):
        if os.path.isfile(value):
            try:
                with Image.open(value) as image:
                    image.verify()
            except Exception:
                raise ConfigError(f"{name} row {row}: {value!r} is not an image file PIL can read.") from None
            raise ConfigError(
                f"{name} row {row}: the image is a path ({value!r}); cast the column to images first: "
                "dataset.cast_column('image', datasets.Image())."
            )
        if os.sep in value or os.path.splitext(value)[1].lower() in (".png", ".jpg", ".jpeg", ".gif", ".webp"):
            raise ConfigError(f"{name} row {row}: the image path {value!r} does not exist.")
        raise ConfigError(f"{name} row {row}: the image is text ({value[:40]!r}), not an image.")
    raise ConfigError(f"{name} row {row}: the image is a {type(value).__name__}, not a PIL image.")


def _short(err: Exception) -> str:
    return str(err).splitlines()[0][:160] if str(err) else type(err).__name__
