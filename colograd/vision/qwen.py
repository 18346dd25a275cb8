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

The engine serves vLLM's Qwen-VL class as `engine_class` makes it: images normalised on the host, and, without
torchvision, no videos (vLLM would otherwise profile its encoder with a dummy video at start-up, which the stand-in
refuses).
"""

import importlib.util
import sys
from typing import Any

from transformers.video_processing_utils import VideoProcessorMixin

# The model types whose processors take `Qwen2VLVideoProcessor`.
MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


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


def install() -> bool:
    """Let transformers build Qwen2-VL / Qwen2.5-VL processors without torchvision, for images (nothing happens where
    torchvision imports). Idempotent. Returns whether the stand-in is in place."""
    if importlib.util.find_spec("torchvision") is not None:
        return False
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING

    sys.modules["transformers"].VideoProcessorMixin = VideoProcessorMixin
    for config_class in (Qwen2VLConfig, Qwen2_5_VLConfig):
        VIDEO_PROCESSOR_MAPPING.register(config_class, {"torchvision": Qwen2VLVideoProcessor}, exist_ok=True)
    return True


def engine_class(model_class: type, stills_only: bool) -> type:
    """vLLM's Qwen-VL `model_class` as colograd's engine serves it (a subclass of the same name and processor).

    - Images are normalised on the host, by the processor, as the trainer's are: vLLM 0.32 otherwise normalises them
      in the model (`supports_mm_device_do_normalize`) with mean / std buffers that are not weights, which the
      engine's dummy start (`load_format="dummy"`, the trainer's weights loaded after) leaves random: the image
      features were 0.26 off the trainer's.
    - `stills_only` (no torchvision: the video processor is `Qwen2VLVideoProcessor` above): no video per prompt, so
      vLLM does not profile its encoder with a dummy video where it profiles (a compiled engine), and a video is
      refused by vLLM itself ("At most 0 video(s) may be provided in one prompt").
    """
    served = type(model_class.__name__, (model_class,), {"supports_mm_device_do_normalize": False})
    if not stills_only:
        return served
    from vllm.multimodal import MULTIMODAL_REGISTRY

    factories = model_class._processor_factory
    info = type(factories.info.__name__, (factories.info,), {"get_supported_mm_limits": _stills})
    register = MULTIMODAL_REGISTRY.register_processor(
        factories.processor, info=info, dummy_inputs=factories.dummy_inputs
    )
    return register(served)


def _stills(info: Any) -> dict[str, int | None]:
    """The items a stills-only Qwen-VL takes per prompt: any number of images, no video."""
    return {"image": None, "video": 0}
