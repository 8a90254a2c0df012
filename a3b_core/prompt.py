"""A conversation as the engine takes it, whatever the model family: earlier turns, the built prompt, and the
[[IMG]] marker that places an image in a user text. Each family's chat template (models/<family>/chat_template.py)
renders them into token ids."""
from __future__ import annotations

from dataclasses import dataclass

IMAGE_MARKER = "[[IMG]]"


@dataclass(frozen=True)
class Turn:
    """One earlier exchange of a conversation."""
    user: str
    assistant: str
    reasoning: str = ""  # dropped when re-rendering history, as the official template does
    num_images: int = 0  # images the user text of that turn referenced; their tokens are part of the history


@dataclass(frozen=True)
class Prompt:
    input_ids: tuple[int, ...]
    image_token_counts: tuple[int, ...]  # LM tokens per image, in order, history images first
    thinking: bool
    text: str  # the rendered text (image pads collapsed to one per image), for display/debug


def count_image_markers(text: str) -> int:
    return text.count(IMAGE_MARKER)
