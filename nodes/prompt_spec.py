"""What travels on an A3B_PROMPT wire: the ingredients of a prompt, built into engine prompts by A3B Generate.

The A3B Prompt node has no model, and per-image mode needs one prompt per image, so the chat template is applied
where both are known: in Generate, through the engine's own `build_prompt`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from a3b_core.errors import PromptError
from a3b_core.prompt import Turn

SINGLE = "single"
PER_IMAGE = "per image"
MODES = [SINGLE, PER_IMAGE]


@dataclass(frozen=True)
class PromptSpec:
    user: str
    system: str = ""
    images: Any = None  # EncodedImages from A3B Image Encode / Video Encode, or None
    thinking: bool = False
    history: tuple[Turn, ...] = ()  # earlier exchanges, oldest first
    history_images: Any = None  # the EncodedImages those exchanges referred to, in order, or None

    @property
    def image_count(self) -> int:
        return 0 if self.images is None else len(self.images)

    def followed_by(self, user: str, system: str, images: Any, thinking: bool, answer: str) -> "PromptSpec":
        """The next prompt of a conversation whose previous prompt was `self` and whose answer was `answer`."""
        if not answer.strip():
            raise PromptError("'previous' is connected but 'previous_answer' is empty. Connect the answer output of "
                              "the A3B Generate node that ran the previous prompt.")
        turn = Turn(user=self.user, assistant=answer, num_images=self.image_count)
        return PromptSpec(user=user, system=system, images=images, thinking=thinking, history=self.history + (turn,),
                          history_images=_joined(self.history_images, self.images))


def build_prompts(model: Any, spec: PromptSpec, mode: str) -> list[Any]:
    """Engine prompts for one generation call: one prompt in single mode, one per image or clip in per-image mode."""
    if mode == SINGLE:
        return [_build(model, spec, spec.images)]
    if mode != PER_IMAGE:
        raise PromptError(f"mode {mode!r} is not one of {MODES}.")
    if not spec.image_count:
        raise PromptError("mode 'per image' needs images or clips, but the prompt has none. Connect an A3B Image "
                          "Encode or A3B Video Encode node to the prompt's 'images' input, or switch mode to 'single'.")
    return [_build(model, spec, spec.images[index]) for index in range(spec.image_count)]


def _joined(first: Any, second: Any) -> Any:
    if first is None or not len(first):
        return second
    return first if second is None else first + second


def _build(model: Any, spec: PromptSpec, images: Any) -> Any:
    return model.build_prompt(user=spec.user, system=spec.system, images=_joined(spec.history_images, images),
                              thinking=spec.thinking, history=spec.history)
