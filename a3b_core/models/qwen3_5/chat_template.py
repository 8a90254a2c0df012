"""The Qwen3.5 chat template, written out in Python: the built-in template, used when the model folder has none (or
the loader's chat_template is "built-in").

The output matches the model's own chat_template.jinja (tests render that file as the oracle): messages are
`<|im_start|>{role}\\n{content}<|im_end|>\\n`, an image is `<|vision_start|><|image_pad|><|vision_end|>` (then
`<|image_pad|>` is repeated once per LM token of that image, as the processor would), and the generation prompt opens
a think block, or writes an empty one when thinking is off.
"""
from __future__ import annotations

from collections.abc import Sequence

from ...prompt import IMAGE_PAD, ImagePart, Message, Prompt, Turn, conversation, tokenize
from ...tokenizer import Tokenizer

_IMAGE_TEXT = "<|vision_start|>" + IMAGE_PAD + "<|vision_end|>"

_THINKING_OPEN = "<think>\n"
_THINKING_SKIPPED = "<think>\n\n</think>\n\n"


def build_prompt(tokenizer: Tokenizer, user: str, *, system: str | None = None,
                 image_token_counts: Sequence[int] = (), thinking: bool = False,
                 history: Sequence[Turn] = (), add_vision_id: bool = False) -> Prompt:
    """Renders a conversation (see prompt.conversation for what it takes) the way Qwen3.5's chat template does and
    tokenizes it. `add_vision_id` labels images "Picture N: ", numbered across the whole conversation."""
    chat = conversation(tokenizer, user, system=system, image_token_counts=image_token_counts, history=history)
    parts = [_message(message, add_vision_id) for message in chat.messages]
    parts.append("<|im_start|>assistant\n" + (_THINKING_OPEN if thinking else _THINKING_SKIPPED))
    text = "".join(parts)
    return Prompt(tuple(tokenize(tokenizer, text, chat.image_token_counts)), chat.image_token_counts, thinking, text)


def _message(message: Message, add_vision_id: bool) -> str:
    content = "".join(_image_text(part.number, add_vision_id) if isinstance(part, ImagePart) else part
                      for part in message.parts).strip()  # trimmed as a whole, like the template's `|trim`
    if message.role == "assistant":
        content = _history_answer(content, message.reasoning)
    return f"<|im_start|>{message.role}\n{content}<|im_end|>\n"


def _image_text(number: int, add_vision_id: bool) -> str:
    return (f"Picture {number}: " if add_vision_id else "") + _IMAGE_TEXT


def _history_answer(answer: str, reasoning: str) -> str:
    """An earlier answer as the template re-renders it: without reasoning."""
    if not reasoning and "</think>" in answer:
        # With no separate reasoning, the template takes everything up to the last </think> as reasoning.
        answer = answer.split("</think>")[-1].lstrip("\n")
    return answer
