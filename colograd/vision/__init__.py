"""Images: pixels for the trainer and the engine, and the checks every image row passes."""

from colograd.moved import forward

__getattr__ = forward(__name__)  # `from colograd.vision import X` as before the move: X from `core`
