"""Many images in one prompt (multi-view prompts carry up to ~30 camera views): when the prompt and the answer would
not fit the context, every image is encoded again at the largest size, the same for all, at which they fit.

A size is a side s in pixels, a multiple of the vision tower's grid (patch x merge, as image.py rounds): "stretch",
"letterbox" and "crop" resize to s x s, "native" keeps the image's shape within s x s pixels. The processor's
minimum pixel count bounds how small an image gets; when even that does not fit, the prompt is refused.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import PromptError
from ..media import image as image_pipeline
from ..runtime.generation import default_context
from ..runtime.inputs import ChatPrompt, EncodedImages, ImageSource

if TYPE_CHECKING:
    from ..runtime.loader import A3BModel


def fit_to_context(model: A3BModel, prompt_for: Callable[[EncodedImages], ChatPrompt], images: EncodedImages,
                   max_new_tokens: int, max_context: int | None = None) -> tuple[ChatPrompt, str]:
    """`prompt_for(images)`, and "" when it fits with `max_new_tokens` in the context (default: the call's default);
    else `prompt_for` of the images encoded again to fit, and a line saying at which size. Images without sources
    (encoded from patches) are left as they are, for generation to report."""
    context = max_context if max_context is not None else default_context(model)
    prompt = prompt_for(images)
    if len(prompt.input_ids) + max_new_tokens <= context or not len(images) or images.sources is None:
        return prompt, ""
    vision = model.config.vision
    patch, factor = vision.patch_size, vision.patch_size * vision.spatial_merge_size
    shapes = [(grid[1] * patch, grid[2] * patch) for grid in images.grids]  # pixels each image has now
    text = len(prompt.input_ids) - sum(images.token_counts)
    room = context - max_new_tokens - text
    largest = max(math.isqrt(h * w) for h, w in shapes) // factor * factor
    for side in range(largest, factor - 1, -factor):
        if sum(_tokens(source, shape, side, factor) for source, shape in zip(images.sources, shapes)) > room:
            continue
        resized = _encoded_at(model, images, side)
        prompt = prompt_for(resized)
        if len(prompt.input_ids) + max_new_tokens <= context:  # "native" shapes were estimated from the grids
            return prompt, (f"{len(images)} image{'s' if len(images) > 1 else ''} at {side}x{side} pixels to fit "
                            f"max_context={context}")
    smallest = sum(_tokens(source, shape, factor, factor) for source, shape in zip(images.sources, shapes))
    raise PromptError(f"the prompt's {len(images)} images need at least {smallest} tokens even at their smallest "
                      f"size, and its text {text}; with max_new_tokens={max_new_tokens} that exceeds "
                      f"max_context={context}. Use fewer images, lower max_new_tokens, or raise max_context (the "
                      "A3B Model Loader's max_context).")


def _tokens(source: ImageSource, shape: tuple[int, int], side: int, factor: int) -> int:
    """LM tokens of an image (now `shape` pixels) encoded at `side`."""
    if source.resize == "native":
        height, width = image_pipeline.smart_resize(*shape, factor, max_pixels=side * side)
    else:
        height, width = image_pipeline.smart_resize(side, side, factor)
    return (height // factor) * (width // factor)


def _encoded_at(model: A3BModel, images: EncodedImages, side: int) -> EncodedImages:
    """`images` (each with its source) encoded again at `side`, keeping their sources and names."""
    vision = model.config.vision
    patches = (image_pipeline.preprocess(s.image, side, s.resize, s.srgb, s.background, vision.patch_size,
                                         vision.temporal_patch_size, vision.spatial_merge_size, side * side)
               for s in images.sources)
    encoded = model.encode_patches(patches, len(images))
    encoded.sources, encoded.names = list(images.sources), list(images.names)
    return encoded
