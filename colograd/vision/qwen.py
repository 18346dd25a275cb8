"""Qwen2-VL and Qwen2.5-VL where torchvision cannot be imported: a stills-only stand-in for their video processor.

transformers 5.19's `Qwen2VLProcessor` and `Qwen2_5_VLProcessor` take a video processor, and theirs
(`Qwen2VLVideoProcessor`) is built on torchvision: without it `AutoProcessor.from_pretrained` of a Qwen-VL folder
fails, in colograd (the trainer's processor) and in vLLM (which builds its own from the model's folder). Two things
stand in the way, and `install` removes both, in this process only:

- the processor checks its video processor against `transformers.VideoProcessorMixin`, which the `transformers`
  package does not export without torchvision (the class itself imports: `transformers.video_processing_utils`);
  `install` puts the real class on the package.
- `AutoVideoProcessor` resolves the folder's `Qwen2VLVideoProcessor` (its `video_preprocessor_config.json`, or the
  image processor's name) to transformers' class, absent here; `install` registers `Qwen2VLVideoProcessor` below
  for both configs, a `VideoProcessorMixin` with the same name and settings that refuses videos in one line.

Images are untouched: they go through transformers' PIL image processor (`Qwen2VLImageProcessorPil`, which
`AutoImageProcessor` picks where torchvision is missing), in the trainer and in the engine alike. Where torchvision
imports, `install` does nothing and transformers' own classes serve.

The engine takes no video (`colograd.vision.core.engine_arguments`), so vLLM never profiles its encoder with a dummy
video at start-up, which the stand-in would refuse.
"""

import importlib.util
import sys
from typing import Any

from transformers.video_processing_utils import VideoProcessorMixin

# The model types whose processors take `Qwen2VLVideoProcessor`, and those (Qwen3.5, dense and MoE: Qwen3-VL's
# processor) that take `Qwen3VLVideoProcessor`.
MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe")


class Qwen2VLVideoProcessor(VideoProcessorMixin):
    """Stands in for transformers' torchvision-only `Qwen2VLVideoProcessor` (same name, so a Qwen-VL folder's
    `video_preprocessor_config.json` finds it): keeps its settings, which vLLM reads (patch, merge and temporal
    patch sizes), and refuses any video in one line. Images never reach it."""

    patch_size = 14
    temporal_patch_size = 2
    merge_size = 2
    min_pixels = 128 * 28 * 28
    max_pixels = 28 * 28 * 768

    def __init__(self, **kwargs: Any) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            if kwargs.get(name) is not None:
                setattr(self, name, kwargs.pop(name))
        super().__init__(**kwargs)

    def preprocess(self, videos: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "videos need torchvision (transformers' Qwen2VLVideoProcessor); colograd serves Qwen-VL without it for "
            "images only (colograd.vision.qwen): give image rows, or install a torchvision that matches torch."
        )


class Qwen3VLVideoProcessor(Qwen2VLVideoProcessor):
    """The same for Qwen3-VL's processor (Qwen3.5's checkpoints): its video processor's name, 16-pixel patches, and
    the settings vLLM reads from it to size its encoder's budget for a video (which colograd's engine never takes):
    the pixel bounds as `size`, frame counts and rate, as transformers' `Qwen3VLVideoProcessor` has them."""

    patch_size = 16
    min_pixels = 128 * 32 * 32
    max_pixels = 32 * 32 * 768
    size = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}
    min_frames, max_frames, fps, max_video_tokens = 4, 768, 2, 768

    def __init__(self, **kwargs: Any) -> None:
        size = kwargs.pop("size", None)
        super().__init__(**kwargs)
        self.size = dict(size or type(self).size)


def install() -> bool:
    """Let transformers build Qwen2-VL / Qwen2.5-VL processors without torchvision, for images (nothing happens where
    torchvision imports). Idempotent. Returns whether the stand-in is in place."""
    if importlib.util.find_spec("torchvision") is not None:
        return False
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3_5Config, Qwen3_5MoeConfig
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING

    sys.modules["transformers"].VideoProcessorMixin = VideoProcessorMixin
    stand_ins = {Qwen2VLConfig: Qwen2VLVideoProcessor, Qwen2_5_VLConfig: Qwen2VLVideoProcessor,
                 Qwen3_5Config: Qwen3VLVideoProcessor, Qwen3_5MoeConfig: Qwen3VLVideoProcessor}  # fmt: skip
    for config_class, stand_in in stand_ins.items():
        VIDEO_PROCESSOR_MAPPING.register(config_class, {"torchvision": stand_in}, exist_ok=True)
    return True
