"""Prompts: datasets loaded, tokenized and streamed, and the tasks colograd generates locally."""

from colograd.moved import forward

__getattr__ = forward(__name__)  # `from colograd.data import X` as before the move: X from `core`
