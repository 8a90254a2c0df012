"""How the built-in chat templates render a conversation, written out in Python (built_in_templates.py holds each
family's formats).

All render messages as `<|im_start|>{role}\\n{content}<|im_end|>\\n`, an image as
`<|vision_start|><|image_pad|><|vision_end|>` and a video as `<|vision_start|><|video_pad|><|vision_end|>` (then
conversation.tokenize writes `<|image_pad|>` out once per LM token of that image, and `<|video_pad|>` out as the video's
timestamped frame groups, as the processor would). What differs, a ChatFormat says: whether texts are trimmed, how
an earlier answer is re-rendered, and what the generation prompt opens with. Tests render the released
chat_template.jinja files as the oracle.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .conversation import (IMAGE_PAD, VIDEO_PAD, ImagePart, MediaTokens, Message, Prompt, Turn, VideoPart, conversation,
                           tokenize)
from .tokenizer import Tokenizer

_VISION_TEXT = {ImagePart: ("Picture", "<|vision_start|>" + IMAGE_PAD + "<|vision_end|>"),
                VideoPart: ("Video", "<|vision_start|>" + VIDEO_PAD + "<|vision_end|>")}


@dataclass(frozen=True)
class ChatFormat:
    trimmed: bool  # system, user and assistant texts are trimmed (Jinja's |trim)
    answer: Callable[[str, str], str]  # an earlier answer (and its separate reasoning) as the template re-renders it
    assistant_opening: Callable[[bool], str]  # what follows "<|im_start|>assistant\n", thinking or not


def render(chat: ChatFormat, tokenizer: Tokenizer, user: str, *, system: str | None = None,
           image_token_counts: Sequence[MediaTokens] = (), thinking: bool = False,
           history: Sequence[Turn] = (), add_vision_id: bool = False) -> Prompt:
    """Renders a conversation (see conversation.conversation for what it takes) the way the chat template of `chat` does
    and tokenizes it. `add_vision_id` labels images "Picture N: " and videos "Video N: ", each numbered across the whole
    conversation."""
    checked = conversation(tokenizer, user, system=system, image_token_counts=image_token_counts, history=history)
    parts = [_message(chat, message, add_vision_id) for message in checked.messages]
    parts.append("<|im_start|>assistant\n" + chat.assistant_opening(thinking))
    text = "".join(parts)
    counts = checked.image_token_counts
    return Prompt(tuple(tokenize(tokenizer, text, counts)), counts, thinking, text)


def _message(chat: ChatFormat, message: Message, add_vision_id: bool) -> str:
    content = "".join(part if isinstance(part, str) else _vision_text(part, add_vision_id) for part in message.parts)
    if chat.trimmed:
        content = content.strip()  # trimmed as a whole, like the template's `|trim`
    if message.role == "assistant":
        content = chat.answer(content, message.reasoning)
    return f"<|im_start|>{message.role}\n{content}<|im_end|>\n"


def _vision_text(part: ImagePart | VideoPart, add_vision_id: bool) -> str:
    label, text = _VISION_TEXT[type(part)]
    return (f"{label} {part.number}: " if add_vision_id else "") + text


def answer_after_thinking(answer: str, reasoning: str) -> str:
    """An earlier answer without its reasoning: with no separate reasoning, templates of thinking models take
    everything up to the answer's last </think> as reasoning."""
    if not reasoning and "</think>" in answer:
        return answer.split("</think>")[-1].lstrip("\n")
    return answer
