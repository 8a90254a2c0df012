"""A conversation as the engine takes it, whatever the model family: earlier turns, the built prompt, and the
[[IMG]] marker that places an image in a user text.

`conversation` checks what a caller gives and lays it out as messages; a chat template (the model folder's own,
chat_template.py, or the family's built-in one, models/<family>/chat_template.py) renders those into text with one
image pad per image, and `tokenize` writes each image out to its number of LM tokens."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

from .errors import PromptError
from .tokenizer import Tokenizer

IMAGE_MARKER = "[[IMG]]"
IMAGE_PAD = "<|image_pad|>"  # a chat template writes it once per image; the image's embedding rows replace its copies


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


@dataclass(frozen=True)
class ImagePart:
    """An image in a user message; `number` counts the conversation's images from 1."""
    number: int


@dataclass(frozen=True)
class Message:
    role: str  # "system", "user" or "assistant"
    parts: tuple[str | ImagePart, ...]  # text as given (templates trim it), images where they go
    reasoning: str = ""  # an assistant message's separate reasoning; empty when there is none


@dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]
    image_token_counts: tuple[int, ...]


def count_image_markers(text: str) -> int:
    return text.count(IMAGE_MARKER)


def conversation(tokenizer: Tokenizer, user: str, *, system: str | None = None, image_token_counts: Sequence[int] = (),
                 history: Sequence[Turn] = ()) -> Conversation:
    """The messages of a prompt, checked.

    `image_token_counts` lists every image of the conversation in order: first the `num_images` of each history turn,
    then the images of `user`. In a user text each `[[IMG]]` marks where the next image goes; a text without markers
    gets its images before the text. A blank `system` means no system message. No text may contain a control token
    (see _check_text).
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

    messages: list[Message] = []
    if system is not None and system.strip():
        if IMAGE_MARKER in system:
            raise PromptError(f"the system message contains {IMAGE_MARKER}, but system messages cannot hold images. "
                              "Move the marker into the user text.")
        messages.append(Message("system", (system,)))

    images_before = 0
    for number, turn in enumerate(history, start=1):
        where = f"history turn {number}"
        messages.append(Message("user", _user_parts(turn.user, turn.num_images, images_before, f"{where} user text",
                                                    f"its num_images is {turn.num_images}")))
        messages.append(Message("assistant", (turn.assistant,), turn.reasoning))
        images_before += turn.num_images

    given = f"{user_images} images were given" if not history_images else (
        f"{user_images} images are left for it ({len(counts)} given, {history_images} belong to history turns)")
    messages.append(Message("user", _user_parts(user, user_images, images_before, "user text", given)))
    return Conversation(tuple(messages), counts)


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


def _user_parts(text: str, num_images: int, images_before: int, where: str,
                given: str) -> tuple[str | ImagePart, ...]:
    """A user text split at its markers, with the images in their places (before the text when it has no marker)."""
    markers = count_image_markers(text)
    images = [ImagePart(images_before + index) for index in range(1, num_images + 1)]
    if markers == 0:
        return (*images, text)
    if markers != num_images:
        raise PromptError(f"the {where} has {markers} {IMAGE_MARKER} markers but {given}. Put one marker where "
                          "each image goes, or remove all markers to place the images before the text.")
    pieces = text.split(IMAGE_MARKER)
    return (pieces[0], *(part for image, piece in zip(images, pieces[1:]) for part in (image, piece)))


def tokenize(tokenizer: Tokenizer, text: str, counts: tuple[int, ...]) -> list[int]:
    """Token ids of a rendered prompt holding one IMAGE_PAD per image (the caller checked), each written out as that
    image's number of pads."""
    chunks = text.split(IMAGE_PAD)
    ids = tokenizer.encode(chunks[0])
    if counts:
        pad = tokenizer.token_id(IMAGE_PAD)
        for count, chunk in zip(counts, chunks[1:]):
            ids += [pad] * count + tokenizer.encode(chunk)
    return ids
