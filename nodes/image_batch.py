"""A3B Image Encode's work: a ComfyUI IMAGE batch through the model's vision tower, one image at a time."""
from __future__ import annotations

from typing import Any

from a3b_core import A3BModel, EncodedImages
from a3b_core.errors import ImageError

from . import comfy_bridge as bridge


def encode_image_batch(model: A3BModel, image: Any, size: int, resize: str, srgb: bool) -> EncodedImages:
    """Encodes `image` ([batch, height, width, channels]) one image at a time: a progress step and a chance to Stop
    per image. A bad image is named by its place in the whole batch."""
    shape = tuple(getattr(image, "shape", ()))
    if len(shape) != 4 or shape[0] == 0:
        what = "an empty batch" if len(shape) == 4 else f"of shape {shape}"
        raise ImageError(f"A3B Image Encode: the 'image' input is {what}; expected a batch of at least one image "
                         "[images, height, width, channels]. Connect a node that gives images, e.g. Load Image.")
    count = shape[0]
    progress = bridge.Progress(count)
    encoded = EncodedImages([], [])
    for index in range(count):
        bridge.raise_if_interrupted()
        try:
            encoded += model.encode_images(image[index:index + 1], size=size, resize=resize, srgb=srgb)
        except ImageError as exc:
            raise ImageError(f"image {index + 1} of {count} in A3B Image Encode's batch: {_root_message(exc)}") from exc
        progress.set(index + 1)
    return encoded


def _root_message(error: ImageError) -> str:
    """The message of the ImageError that started the chain: the engine's own wrapper numbers this one image
    "1 of 1", which says nothing about the batch."""
    while isinstance(error.__cause__, ImageError):
        error = error.__cause__
    return str(error)
