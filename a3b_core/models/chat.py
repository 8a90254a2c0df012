"""The chat templates of the Qwen families, written out in Python, producing token ids with every image already
expanded.

All render messages as `<|im_start|>{role}\\n{content}<|im_end|>\\n` and an image as
`<|vision_start|><|image_pad|><|vision_end|>` (here with its `<|image_pad|>` repeated once per LM token of that image,
as the processor would). What differs, a ChatFormat says: whether texts are trimmed, how an earlier answer is
re-rendered, and what the generation prompt opens with. Each family's chat_template.py holds its formats; tests render
the released chat_template.jinja files as the oracle.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral

from ..errors import PromptError
from ..prompt import IMAGE_MARKER, Prompt, Turn, count_image_markers
from ..tokenizer import Tokenizer

_VISION_START = "<|vision_start|>"
_IMAGE_PAD = "<|image_pad|>"
_VISION_END = "<|vision_end|>"
_IMAGE_TEXT = _VISION_START + _IMAGE_PAD + _VISION_END



@dataclass(frozen=True)
class ChatFormat:
    trimmed: bool  # system, user and assistant texts are trimmed (Jinja's |trim)
    answer: Callable[[Turn], str]  # an earlier turn's answer as the template re-renders it
    assistant_opening: Callable[[bool], str]  # what follows "<|im_start|>assistant\n", thinking or not


def render(chat: ChatFormat, tokenizer: Tokenizer, user: str, *, system: str | None = None,
           image_token_counts: Sequence[int] = (), thinking: bool = False,
           history: Sequence[Turn] = (), add_vision_id: bool = False) -> Prompt:
    """Renders a conversation the way the chat template of `chat` does and tokenizes it.

    `image_token_counts` lists every image of the conversation in order: first the `num_images` of each history turn,
    then the images of `user`. In a user text each `[[IMG]]` marks where the next image goes; a text without markers
    gets its images before the text. A blank `system` means no system message. `add_vision_id` labels images
    "Picture N: ", numbered across the whole conversation. No text may contain a control token (see _check_text).
    """
    for name, value in (("user", user), ("system", system)):
        if value is not None and not isinstance(value, str) or name == "user" and value is None:
            raise PromptError(f"the {name} text is a {type(value).__name__}; pass a string.")
    counts = _checked_token_counts(image_token_counts)
    for number, turn in enumerate(history, start=1):
        if turn.num_images < 0:
            raise PromptError(f"history turn {number} has num_images={turn.num_images}; it must be 0 or more "
                              "(the number of images its user text referenced).")
    history_images = sum(turn.num_images for turn in history)
    if history_images > len(counts):
        raise PromptError(
            f"history turns reference {history_images} images but image_token_counts lists only {len(counts)}. "
            "Pass the earlier turns' images first, then the images of the current user text.")
    user_images = len(counts) - history_images
    texts = [(user, "user text"), (system or "", "system message")]
    for number, turn in enumerate(history, start=1):
        texts += [(turn.user, f"history turn {number} user text"),
                  (turn.assistant, f"history turn {number} assistant text")]
    for text, where in texts:
        _check_text(text, where, tokenizer.control_tokens)
    if not user.strip() and user_images == 0:
        raise PromptError("the prompt is empty: the user text is blank and no image was given. "
                          "Write a request in the user text or connect an image.")

    trim = str.strip if chat.trimmed else str
    parts: list[str] = []
    if system is not None and system.strip():
        if IMAGE_MARKER in system:
            raise PromptError(f"the system message contains {IMAGE_MARKER}, but system messages cannot hold images. "
                              "Move the marker into the user text.")
        parts.append(_message("system", trim(system)))

    images_before = 0
    for number, turn in enumerate(history, start=1):
        where = f"history turn {number}"
        content = _user_content(turn.user, turn.num_images, images_before, add_vision_id, f"{where} user text",
                                f"its num_images is {turn.num_images}")
        parts.append(_message("user", trim(content)))
        parts.append(_message("assistant", chat.answer(turn)))
        images_before += turn.num_images

    given = f"{user_images} images were given" if not history_images else (
        f"{user_images} images are left for it ({len(counts)} given, {history_images} belong to history turns)")
    parts.append(_message("user", trim(_user_content(user, user_images, images_before, add_vision_id, "user text",
                                                     given))))
    parts.append("<|im_start|>assistant\n" + chat.assistant_opening(thinking))

    text = "".join(parts)
    return Prompt(tuple(_tokenize(tokenizer, text, counts)), counts, thinking, text)


def _checked_token_counts(image_token_counts: Sequence[int]) -> tuple[int, ...]:
    for index, count in enumerate(image_token_counts):
        if isinstance(count, bool) or not isinstance(count, Integral) or count < 1:
            raise PromptError(f"image_token_counts[{index}] is {count!r}; each image needs a whole number of LM "
                              "tokens, at least 1. Use the token counts of the encoded images.")
    return tuple(int(count) for count in image_token_counts)


def _check_text(text: str, where: str, control_tokens: frozenset[str]) -> None:
    """Text from a workflow or a file must never forge a turn (`<|im_end|>` then `<|im_start|>system`) or move the
    image pads away from their images, so it may hold none of the tokenizer's control tokens."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(f"the {where} contains a character that is not valid Unicode ({exc.object[exc.start]!r} at "
                          f"position {exc.start}); remove it or re-type the text.") from None
    for token in sorted(control_tokens):
        if token in text:
            raise PromptError(f"the {where} contains the control token {token}, which only the chat template may "
                              f"write: text cannot start a turn or place an image. Remove it (write {IMAGE_MARKER} "
                              "where an image goes).")


def _message(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def _user_content(text: str, num_images: int, images_before: int, add_vision_id: bool, where: str,
                  given: str) -> str:
    """The user text with its images in place."""
    markers = count_image_markers(text)
    if markers == 0:
        pieces = [""] * num_images + [text]  # no marker: all images before the text
    elif markers != num_images:
        raise PromptError(f"the {where} has {markers} {IMAGE_MARKER} markers but {given}. Put one marker where "
                          "each image goes, or remove all markers to place the images before the text.")
    else:
        pieces = text.split(IMAGE_MARKER)
    images = [_image_text(images_before + index, add_vision_id) for index in range(1, num_images + 1)]
    return pieces[0] + "".join(image + piece for image, piece in zip(images, pieces[1:]))


def _image_text(number: int, add_vision_id: bool) -> str:
    return (f"Picture {number}: " if add_vision_id else "") + _IMAGE_TEXT


def answer_after_thinking(answer: str, reasoning: str) -> str:
    """An earlier answer without its reasoning: with no separate reasoning, templates of thinking models take
    everything up to the answer's last </think> as reasoning."""
    if not reasoning and "</think>" in answer:
        return answer.split("</think>")[-1].lstrip("\n")
    return answer


def _tokenize(tokenizer: Tokenizer, text: str, counts: tuple[int, ...]) -> list[int]:
    """Token ids of `text`, each image's single pad written out as that image's number of pads."""
    chunks = text.split(_IMAGE_TEXT)  # user text cannot contain vision tokens, so this splits at images only
    ids = tokenizer.encode(chunks[0])
    if counts:
        start, pad, end = (tokenizer.token_id(t) for t in (_VISION_START, _IMAGE_PAD, _VISION_END))
        for count, chunk in zip(counts, chunks[1:]):
            ids += [start] + [pad] * count + [end] + tokenizer.encode(chunk)
    return ids
