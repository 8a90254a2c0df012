"""A3B Image Encode's work: a ComfyUI IMAGE batch through the model's vision tower."""
from __future__ import annotations

from typing import Any

from a3b_core import A3BModel, EncodedImages
from a3b_core.errors import ImageError

from . import comfy_bridge as bridge


def encode_image_batch(model: A3BModel, image: Any, size: int, resize: str, srgb: bool) -> EncodedImages:
    """Encodes `image` ([batch, height, width, channels]) in one engine call, so a bad image is named by its place in
    the whole batch; a progress step and a chance to Stop after each image."""
    shape = tuple(getattr(image, "shape", ()))
    if len(shape) != 4 or shape[0] == 0:
        what = "an empty batch" if len(shape) == 4 else f"of shape {shape}"
        raise ImageError(f"A3B Image Encode: the 'image' input is {what}; expected a batch of at least one image "
                         "[images, height, width, channels]. Connect a node that gives images, e.g. Load Image.")
    progress = bridge.Progress(shape[0])

    def after_image(done: int, total: int) -> None:
        progress.set(done)
        bridge.raise_if_interrupted()

    bridge.raise_if_interrupted()
    return model.encode_images(image, size=size, resize=resize, srgb=srgb, progress=after_image)
