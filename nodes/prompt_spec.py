"""What travels on an A3B_PROMPT wire: the ingredients of a prompt, built into engine prompts by A3B Generate.

The A3B Prompt node has no model, and per-image mode needs one prompt per image, so the chat template is applied
where both are known: in Generate, through the engine's own `build_prompt`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from a3b_core.errors import PromptError
from a3b_core.prompting.conversation import Turn
from a3b_core.runtime.loader import A3BModel
from a3b_core.services.context_fit import fit_to_context

AUTO_THINKING = "auto"
THINKING_MODES = {AUTO_THINKING: None, "on": True, "off": False}  # A3B Prompt's choice -> build_prompt's thinking
SINGLE = "single"
PER_IMAGE = "per image"
MODES = [SINGLE, PER_IMAGE]


@dataclass(frozen=True)
class PromptSpec:
    user: str
    system: str = ""
    images: Any = None  # EncodedImages from A3B Image Encode / Video Encode, or None
    thinking: bool | None = None  # None: the model's own default
    history: tuple[Turn, ...] = ()  # earlier exchanges, oldest first
    history_images: Any = None  # the EncodedImages those exchanges referred to, in order, or None

    @property
    def image_count(self) -> int:
        return 0 if self.images is None else len(self.images)

    def followed_by(self, user: str, system: str, images: Any, thinking: bool | None, answer: str) -> "PromptSpec":
        """The next prompt of a conversation whose previous prompt was `self` and whose answer was `answer`."""
        if not answer.strip():
            raise PromptError("'previous' is connected but 'previous_answer' is empty. Connect the answer output of "
                              "the A3B Generate node that ran the previous prompt.")
        turn = Turn(user=self.user, assistant=answer, num_images=self.image_count)
        return PromptSpec(user=user, system=system, images=images, thinking=thinking, history=self.history + (turn,),
                          history_images=_joined(self.history_images, self.images))


def build_prompts(model: Any, spec: PromptSpec, mode: str) -> list[Any]:
    """Engine prompts for one generation call: one prompt in single mode, one per image or clip in per-image mode."""
    return [prompt for prompt, _ in _prompts(model, spec, mode, None)]


def fitted_prompts(model: Any, spec: PromptSpec, mode: str, max_new_tokens: int) -> tuple[list[Any], str]:
    """build_prompts, with the images of a local model's prompt that would not fit the context together with
    `max_new_tokens` encoded again at a size at which they fit; and a line saying so ("" when none was)."""
    built = _prompts(model, spec, mode, max_new_tokens)
    return [prompt for prompt, _ in built], " · ".join(dict.fromkeys(note for _, note in built if note))


def _prompts(model: Any, spec: PromptSpec, mode: str, max_new_tokens: int | None) -> list[tuple[Any, str]]:
    if mode == SINGLE:
        return [_build(model, spec, spec.images, max_new_tokens)]
    if mode != PER_IMAGE:
        raise PromptError(f"mode {mode!r} is not one of {MODES}.")
    if not spec.image_count:
        raise PromptError("mode 'per image' needs images or clips, but the prompt has none. Connect an A3B Image "
                          "Encode or A3B Video Encode node to the prompt's 'images' input, or switch mode to 'single'.")
    return [_build(model, spec, spec.images[index], max_new_tokens) for index in range(spec.image_count)]


def _joined(first: Any, second: Any) -> Any:
    if first is None or not len(first):
        return second
    return first if second is None else first + second


def _build(model: Any, spec: PromptSpec, images: Any, max_new_tokens: int | None) -> tuple[Any, str]:
    """The prompt and, when its images were shrunk to fit the context, a line saying so. Only a local model knows its
    context; a remote server reports an overflow itself."""
    joined = _joined(spec.history_images, images)

    def prompt_for(encoded: Any) -> Any:
        return model.build_prompt(user=spec.user, system=spec.system, images=encoded, thinking=spec.thinking,
                                  history=spec.history)

    if max_new_tokens is None or joined is None or not isinstance(model, A3BModel):
        return prompt_for(joined), ""
    return fit_to_context(model, prompt_for, joined, max_new_tokens)
