"""Images of every PIL mode, as real datasets ship them, on the tiny LLaVA (`colograd.vision.images.to_rgb`, through
`check_row`): 16-bit, 32-bit and float grayscale keep their picture instead of turning white, transparent images are
put on white as the engine puts them, a mode that cannot be converted is refused naming its row; and the refusals
real layouts met: LLaVA-Instruct's `conversations` without a `prompt`, images with partial rollouts."""

import functools
import json

import numpy as np
import pytest
import torch
from datasets import Dataset
from PIL import Image

from colograd import GRPOTrainer
from colograd.config.data import ScriptArguments
from colograd.data.core import load_prompts
from colograd.errors import ConfigError
from colograd.models.tiny import run_config
from colograd.models.tiny_vlm import QUESTION, build_model, build_processor, colour_reward, colours_dataset
from colograd.vision.checks import check_image_data, check_row
from colograd.vision.core import image_prompts
from colograd.vision.images import to_rgb

USER = [{"role": "user", "content": QUESTION}]
# A horizontal gradient, 0 to 255 across 256 columns, 28 rows (the tiny LLaVA's image side).
GRADIENT = np.tile(np.arange(256, dtype=np.uint8), (28, 1))


@functools.cache
def _processor():
    return build_processor()


def _check(image: Image.Image) -> Image.Image:
    (converted,) = check_row({"prompt": USER, "image": image}, "train_dataset row 9", _processor())
    return converted


def _pixels(image: Image.Image) -> torch.Tensor:
    """The trainer's pixel values of a one-image prompt (`image_prompts`, as every rollout processes its rows)."""
    return image_prompts(_processor(), [USER], [[image]])[2][0]["pixel_values"]


def _wide(mode: str) -> Image.Image:
    """GRADIENT stored as a wide-mode image, each in a range real files use."""
    if mode in ("I;16", "I;16L", "I;16B"):  # a 16-bit PNG's full range: 0-65535
        dtype = ">u2" if mode == "I;16B" else "<u2"
        return Image.frombytes(mode, (256, 28), (GRADIENT.astype(np.uint16) * 257).astype(dtype).tobytes())
    if mode == "I":  # 32-bit integers, 12-bit data offset by 1000 (a scanner's)
        return Image.fromarray(GRADIENT.astype(np.int32) * 16 + 1000)
    if mode == "F 0-1":  # floats in 0-1
        return Image.fromarray(GRADIENT.astype(np.float32) / 255)
    return Image.fromarray(GRADIENT.astype(np.float32) * 4.0 - 500.0)  # floats of any range


@pytest.mark.parametrize("mode", ["I;16", "I;16L", "I;16B", "I", "F 0-1", "F"])
def test_wide_grayscale_keeps_its_picture(mode):
    """A 16-bit PNG (mode I;16) came out white in every pixel through the processor's convert("RGB"): the gradient
    is now the 8-bit gradient, scaled by its range rather than clipped, for the trainer and (the same image) the
    engine."""
    wide = _wide(mode)
    assert wide.mode == mode.split()[0]
    converted = _check(wide)
    assert converted.mode == "RGB" and np.array_equal(np.asarray(converted), np.stack([GRADIENT] * 3, axis=-1))
    eight_bit = Image.fromarray(GRADIENT).convert("RGB")
    assert torch.equal(_pixels(converted), _pixels(eight_bit))
    # What the processor made of it alone: white (or nearly) in every pixel, the picture gone.
    if mode.startswith("I;16"):
        assert (np.asarray(wide.convert("RGB")) == 255).mean() > 0.99


def test_a_rollout_gives_the_engine_and_the_trainer_the_16_bit_picture(tmp_path):
    """The rollout's own path (`GRPOTrainer.prepare_prompts`, which every rollout and refill runs): the images the
    engine gets and the pixels the trainer gets are the 8-bit gradient's, not a white image."""
    from types import SimpleNamespace

    from colograd.data.streaming import ROW_KEY

    fake = SimpleNamespace(
        _vision=True,
        inputs=SimpleNamespace(images_per_prompt=1),
        processing_class=_processor(),
        args=run_config(str(tmp_path), 1, max_prompt_length=None),
        prompt_limit=64,
    )
    prepared = GRPOTrainer.prepare_prompts(
        fake, [{"prompt": USER, "image": _wide("I;16"), ROW_KEY: "train_dataset row 4"}]
    )
    eight_bit = Image.fromarray(GRADIENT).convert("RGB")
    (engine_image,) = prepared.images.images[0]
    assert np.array_equal(np.asarray(engine_image), np.asarray(eight_bit))
    assert torch.equal(prepared.images.pixels[0]["pixel_values"], _pixels(eight_bit))


def test_8_bit_values_in_a_wide_mode_are_kept_and_a_constant_image_stays_one_value():
    kept = Image.fromarray(GRADIENT.astype(np.uint16))  # 0-255 in an I;16 image: 8-bit data, not stretched
    assert kept.mode == "I;16" and np.array_equal(np.asarray(to_rgb(kept, "x"))[..., 0], GRADIENT)
    for value, expected in ((0, 0), (40000, 255)):
        flat = Image.fromarray(np.full((4, 4), value, np.uint16))
        assert np.unique(np.asarray(to_rgb(flat, "x"))).tolist() == [expected]
    nan = np.asarray(GRADIENT, np.float32) / 255
    nan[0, 0] = np.nan
    assert np.asarray(to_rgb(Image.fromarray(nan), "x"))[0, 0, 0] == 0  # a NaN takes the least value


@pytest.mark.parametrize("mode", ["RGBA", "LA", "PA", "La", "RGBa", "P with transparency"])
def test_a_transparent_image_is_put_on_white_as_the_engine_does(mode):
    """A black glyph on a transparent background: vLLM's conversion puts it on white, transformers' dropped the alpha
    (black on black), so the engine and the trainer saw different pictures. Both now get vLLM's."""
    from vllm.multimodal.image import convert_image_mode

    rgba = Image.new("RGBA", (28, 28), (0, 0, 0, 0))
    rgba.paste((0, 0, 0, 255), (7, 7, 21, 21))  # an opaque black square
    if mode == "P with transparency":
        image = rgba.convert("P")
        image.info["transparency"] = image.getpixel((0, 0))
        assert image.getpixel((0, 0)) != image.getpixel((10, 10))
    else:
        image = rgba.convert(mode) if mode not in ("La", "RGBa") else rgba.convert("LA" if mode == "La" else mode)
        if mode == "La":
            image = Image.frombytes("La", image.size, image.tobytes())
    converted = _check(image)
    # vLLM converts premultiplied alpha (La, RGBa) with PIL's convert("RGB"), which fails on La: it gets them as
    # their plain twins (LA, RGBA), which its conversion puts on white.
    engine = convert_image_mode(image.convert({"La": "LA", "RGBa": "RGBA"}.get(mode, image.mode)), "RGB")
    assert np.array_equal(np.asarray(converted), np.asarray(engine))
    assert converted.getpixel((0, 0)) == (255, 255, 255) and converted.getpixel((10, 10)) == (0, 0, 0)
    assert torch.equal(_pixels(converted), _pixels(engine))


@pytest.mark.parametrize("mode", ["1", "L", "P", "CMYK", "YCbCr", "LAB", "HSV", "RGBX"])
def test_the_other_modes_convert_as_pil_converts_them(mode):
    image = Image.fromarray(np.stack([GRADIENT, GRADIENT[:, ::-1], GRADIENT // 2], axis=-1)).convert(mode)
    converted = _check(image)
    assert converted.mode == "RGB" and np.array_equal(np.asarray(converted), np.asarray(image.convert("RGB")))


def test_an_image_that_cannot_be_converted_is_refused_naming_its_row_and_field():
    nothing = Image.fromarray(np.full((4, 4), np.nan, np.float32))
    with pytest.raises(ConfigError, match="^train_dataset row 9: 'image' is a float image .* no finite value"):
        _check(nothing)
    odd = Image.new("CMYK", (4, 4))
    odd.convert = lambda mode: (_ for _ in ()).throw(ValueError("conversion from CMYK to RGB not supported"))
    row = {"prompt": USER, "images": [Image.new("RGB", (4, 4)), odd]}
    with pytest.raises(ConfigError) as err:
        check_row(row, "train_dataset row 9", _processor())
    assert str(err.value).startswith(
        "train_dataset row 9: 'images[1]' is a PIL image of mode 'CMYK', which PIL cannot convert to RGB"
    )
    assert "\n" not in str(err.value)


LLAVA_INSTRUCT = {
    "id": "000000033471",
    "conversations": [
        {"from": "human", "value": "<image>\nWhat are the colors of the bus in the image?"},
        {"from": "gpt", "value": "The bus in the image is white and red."},
    ],
}


def test_llava_instruct_rows_are_told_the_mapping_that_gives_them_a_prompt(tmp_path):
    """LLaVA-Instruct as shipped: `conversations` (from / value), no `prompt`. It was told "the prompt is text"; it is
    now told the `dataset.map` to write, and the map it is told gives a row that passes."""
    row = {**LLAVA_INSTRUCT, "image": Image.fromarray(GRADIENT)}
    with pytest.raises(ConfigError) as err:
        check_row(row, "train_dataset row 0", _processor())
    message = str(err.value)
    assert message.startswith("train_dataset row 0: it has a 'conversations' column and no 'prompt' (the LLaVA")
    assert "the prompt is text" not in message and "\n" not in message
    mapping = eval(message.split("dataset = dataset.map(")[1].removesuffix(")."))  # noqa: S307 — the message's own code
    fixed = {**row, **mapping(row)}
    assert fixed["prompt"] == [{"role": "user", "content": "What are the colors of the bus in the image?"}]
    assert len(check_row(fixed, "train_dataset row 0", _processor())) == 1
    # Before start-up, on a dataset (the image a path, as shipped, is not what it is told first), through the
    # trainer, and from a file.
    dataset = Dataset.from_list([{**LLAVA_INSTRUCT, "image": "000000033471.jpg"}])
    with pytest.raises(ConfigError, match="^train_dataset row 0: it has a 'conversations' column"):
        check_image_data(build_model(), _processor(), dataset)
    args = run_config(str(tmp_path / "out"), 1, max_prompt_length=None)
    with pytest.raises(ConfigError, match="^train_dataset row 0: it has a 'conversations' column"):
        GRPOTrainer(build_model(), colour_reward, args=args, train_dataset=Dataset.from_list([row] * 4),
                    processing_class=_processor())  # fmt: skip
    path = tmp_path / "llava_instruct.jsonl"
    path.write_text(json.dumps({**LLAVA_INSTRUCT, "image": "000000033471.jpg"}) + "\n")
    with pytest.raises(ConfigError, match=f"^dataset '{path}': it has a 'conversations' column") as err:
        load_prompts(ScriptArguments(dataset_name=str(path)))
    assert "row['conversations'][0]['value']" in str(err.value)
    # ShareGPT's role / content turns are named by their own keys.
    sharegpt = {"conversations": [{"role": "user", "content": "hi"}], "image": Image.fromarray(GRADIENT)}
    with pytest.raises(ConfigError, match=r"row\['conversations'\]\[0\]\['content'\]"):
        check_row(sharegpt, "train_dataset row 0", _processor())


def test_partial_rollouts_on_images_are_told_images_are_not_supported(tmp_path):
    """It was told to "cast that column to text or numbers" (the JSON check of carried rows met the images first)."""
    args = run_config(str(tmp_path), 1, partial_rollouts=True, max_prompt_length=None)
    with pytest.raises(ConfigError) as err:
        GRPOTrainer(build_model(), colour_reward, args=args, train_dataset=colours_dataset(8),
                    processing_class=_processor())  # fmt: skip
    assert str(err.value).startswith("images are not supported with partial_rollouts")
    assert "cast that column" not in str(err.value)
