"""The Qwen3.5 chat template, built in (models/chat.py renders it): texts trimmed, earlier answers without reasoning,
and a generation prompt that opens a think block, or writes an empty one when thinking is off."""
from __future__ import annotations

from functools import partial
from pathlib import Path

from ..chat import ChatFormat, answer_after_thinking, render

QWEN3_5 = ChatFormat(
    trimmed=True,
    answer=answer_after_thinking,  # the answer arrives trimmed
    assistant_opening=lambda thinking: "<think>\n" if thinking else "<think>\n\n</think>\n\n",
)

build_prompt = partial(render, QWEN3_5)


def thinking_as_asked(folder: Path) -> None:
    """Qwen3.5/3.6 think or not as each prompt asks."""
    return None
