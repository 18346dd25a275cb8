"""Every image as the processor and the engine take it: 8-bit RGB, with its picture.

The processors colograd serves convert an image with PIL's `convert("RGB")` (transformers 5.19's `convert_to_rgb`),
which clips wider values to 8 bits: a 16-bit grayscale image (PIL mode `I;16`, what a 16-bit PNG decodes to) comes
out white in every pixel, silently. vLLM's own conversion differs besides: it puts a transparent image on white, where
transformers drops the alpha (a black glyph on a transparent background becomes black on black). `to_rgb` converts
each image once, before both see it, so the engine and the trainer get the same RGB pixels, and the picture:

- modes of more than 8 bits per pixel (`I;16`, `I;16B`, `I;16L`, `I;16N`, `I`, `F`): a float image's values in 0-1
  are scaled by 255, values in 0-255 kept as they are (8-bit data in a wider mode), and any others scaled from the
  image's own range (its least value to 0, its greatest to 255), not clipped;
- modes with transparency (`RGBA`, `LA`, `PA`, `La`, `RGBa`, or a palette / grayscale image with a transparent
  colour) are put on white, as vLLM does;
- the rest (`1`, `L`, `P`, `CMYK`, `YCbCr`, `LAB`, `HSV`, `RGBX`) by PIL's own conversion;
- a mode PIL cannot convert is refused in one line naming the row and the field.
"""

import numpy as np
from PIL import Image

from colograd.errors import ConfigError

# Modes whose pixels hold more than 8 bits: PIL's convert("RGB") clips them.
_WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")
# Modes with an alpha channel (premultiplied ones first unpremultiplied by PIL's conversion).
_ALPHA_MODES = ("RGBA", "LA", "PA", "La", "RGBa")


def to_rgb(image: Image.Image, what: str) -> Image.Image:
    """`image` as an 8-bit RGB image with its picture (the module's rules); an RGB image as it is.

    Args:
        image: a PIL image of any mode.
        what: how messages name it ("train_dataset row 300: 'images[1]'").

    Raises:
        ConfigError: a mode PIL cannot convert, or a float image with no finite value.
    """
    if image.mode == "RGB":
        return image
    if image.mode in _WIDE_MODES:
        return Image.fromarray(_eight_bit(np.asarray(image), what), "L").convert("RGB")
    try:
        if image.mode in _ALPHA_MODES or "transparency" in image.info:
            # La converts to RGBA only through LA (PIL has no direct conversion).
            rgba = (image.convert("LA") if image.mode == "La" else image).convert("RGBA")
            white = Image.new("RGB", image.size, (255, 255, 255))
            white.paste(rgba, mask=rgba.getchannel("A"))
            return white
        return image.convert("RGB")
    except (ValueError, OSError) as err:
        raise ConfigError(
            f"{what} is a PIL image of mode {image.mode!r}, which PIL cannot convert to RGB ({err}); convert the "
            "column's images to RGB (or L) before training, e.g. dataset.map(...) with image.convert('RGB')."
        ) from None


def _eight_bit(values: np.ndarray, what: str) -> np.ndarray:
    """A wide image's values [H, W] as uint8 [H, W]: a float image's in 0-1 times 255; values in 0-255 as they are;
    others scaled from their own least to their greatest value. Non-finite float values take the least finite one."""
    floats = values.dtype.kind == "f"
    values = values.astype(np.float64)
    finite = np.isfinite(values)
    if not finite.any():
        raise ConfigError(f"{what} is a float image (PIL mode 'F') with no finite value (all NaN or infinite).")
    low, high = float(values[finite].min()), float(values[finite].max())
    values = np.where(finite, values, low)
    if floats and low >= 0 and high <= 1:
        return np.round(values * 255).astype(np.uint8)
    if low >= 0 and high <= 255:
        return np.round(values).astype(np.uint8)
    low = min(low, 0.0) if high == low else low  # a constant image: 0 stays black, any other value white
    return np.round((values - low) * (255 / ((high - low) or 1))).astype(np.uint8)
