"""A conversation as the engine takes it, whatever the model family: earlier turns, the built prompt, and the
[[IMG]] and [[VID]] markers that place an image or a video in a user text.

`conversation` checks what a caller gives and lays it out as messages; a chat template (the model folder's own,
folder_template.py, or the family's built-in one, built_in_templates.py) renders those into text with one
image pad per image and one video pad per video, and `tokenize` writes each image out to its number of LM tokens and
each video out to its frame groups, each a timestamp then its tokens."""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

from ..errors import PromptError
from .tokenizer import Tokenizer

IMAGE_MARKER = "[[IMG]]"
VIDEO_MARKER = "[[VID]]"
IMAGE_PAD = "<|image_pad|>"  # a chat template writes it once per image; the image's embedding rows replace its copies
VIDEO_PAD = "<|video_pad|>"  # likewise once per video; tokenize writes out its frame groups
_MARKERS = re.compile(re.escape(IMAGE_MARKER) + "|" + re.escape(VIDEO_MARKER))
_PADS = re.compile(re.escape(IMAGE_PAD) + "|" + re.escape(VIDEO_PAD))


@dataclass(frozen=True)
class VideoTokens:
    """What a video adds to a prompt: per frame group "<{seconds:.1f} seconds>", then vision_start, `group_tokens` video
    pads and vision_end (as Qwen's processor writes it)."""
    group_tokens: int  # LM tokens of each frame group
    timestamps: tuple[float, ...]  # seconds of each frame group


MediaTokens = int | VideoTokens  # an image's LM token count, or a video's


@dataclass(frozen=True)
class Turn:
    """One earlier exchange of a conversation."""
    user: str
    assistant: str
    reasoning: str = ""  # the built-in templates drop it when re-rendering history; a folder's template may write it
    num_images: int = 0  # images and videos the user text of that turn referenced; their tokens are in the history


@dataclass(frozen=True)
class Prompt:
    input_ids: tuple[int, ...]
    image_token_counts: tuple[MediaTokens, ...]  # per image (its LM tokens) or video, in order, history ones first
    thinking: bool
    text: str  # the rendered text (image pads collapsed to one per image), for display/debug


@dataclass(frozen=True)
class ImagePart:
    """An image in a user message; `number` counts the conversation's images from 1."""
    number: int


@dataclass(frozen=True)
class VideoPart:
    """A video in a user message; `number` counts the conversation's videos from 1."""
    number: int


@dataclass(frozen=True)
class Message:
    role: str  # "system", "user" or "assistant"
    parts: tuple[str | ImagePart | VideoPart, ...]  # text as given (templates trim it), images and videos in place
    reasoning: str = ""  # an assistant message's separate reasoning; empty when there is none


@dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]
    image_token_counts: tuple[MediaTokens, ...]


def count_image_markers(text: str) -> int:
    """The image and video markers of a text."""
    return len(_MARKERS.findall(text))


def conversation(tokenizer: Tokenizer, user: str, *, system: str | None = None,
                 image_token_counts: Sequence[MediaTokens] = (), history: Sequence[Turn] = ()) -> Conversation:
    """The messages of a prompt, checked.

    `image_token_counts` lists every image (its LM token count) and video (its VideoTokens) of the conversation in
    order: first the `num_images` of each history turn, then those of `user`. In a user text each `[[IMG]]` marks
    where the next item, an image, goes, and each `[[VID]]` where the next item, a video, goes; a text without markers
    gets its items before the text. A blank `system` means no system message. No text may contain a control token
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
                  (turn.assistant, f"history turn {number} assistant text"),
                  (turn.reasoning, f"history turn {number} reasoning")]
    for text, where in texts:
        _check_text(text, where, tokenizer.control_tokens)
    if not user.strip() and user_images == 0:
        raise PromptError("the prompt is empty: the user text is blank and no image was given. "
                          "Write a request in the user text or connect an image.")

    messages: list[Message] = []
    if system is not None and system.strip():
        if count_image_markers(system):
            raise PromptError(f"the system message contains {IMAGE_MARKER} or {VIDEO_MARKER}, but system messages "
                              "cannot hold images or videos. Move the marker into the user text.")
        messages.append(Message("system", (system,)))

    used = 0
    for number, turn in enumerate(history, start=1):
        where = f"history turn {number}"
        messages.append(Message("user", _user_parts(turn.user, counts[used:used + turn.num_images], counts[:used],
                                                    f"{where} user text", f"its num_images is {turn.num_images}")))
        messages.append(Message("assistant", (turn.assistant,), turn.reasoning))
        used += turn.num_images

    given = f"{user_images} images were given" if not history_images else (
        f"{user_images} images are left for it ({len(counts)} given, {history_images} belong to history turns)")
    messages.append(Message("user", _user_parts(user, counts[used:], counts[:used], "user text", given)))
    return Conversation(tuple(messages), counts)


def _checked_token_counts(image_token_counts: Sequence[MediaTokens]) -> tuple[MediaTokens, ...]:
    for index, count in enumerate(image_token_counts):
        if isinstance(count, VideoTokens):
            if (isinstance(count.group_tokens, bool) or not isinstance(count.group_tokens, Integral)
                    or count.group_tokens < 1 or not count.timestamps):
                raise PromptError(f"image_token_counts[{index}] is {count!r}; a video needs at least one frame group "
                                  "of at least 1 LM token. Use the prompt tokens of the encoded video.")
        elif isinstance(count, bool) or not isinstance(count, Integral) or count < 1:
            raise PromptError(f"image_token_counts[{index}] is {count!r}; each image needs a whole number of LM "
                              "tokens, at least 1. Use the token counts of the encoded images.")
    return tuple(count if isinstance(count, VideoTokens) else int(count) for count in image_token_counts)


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


def _user_parts(text: str, items: Sequence[MediaTokens], items_before: Sequence[MediaTokens], where: str,
                given: str) -> tuple[str | ImagePart | VideoPart, ...]:
    """A user text split at its markers, with its images and videos in their places (before the text when it has no
    marker); images and videos are numbered separately across the conversation."""
    videos_before = sum(isinstance(item, VideoTokens) for item in items_before)
    numbers = {ImagePart: len(items_before) - videos_before, VideoPart: videos_before}
    parts = []
    for item in items:
        kind = VideoPart if isinstance(item, VideoTokens) else ImagePart
        numbers[kind] += 1
        parts.append(kind(numbers[kind]))
    markers = _MARKERS.findall(text)
    if not markers:
        return (*parts, text)
    if len(markers) != len(items):
        videos = VIDEO_MARKER in markers or any(isinstance(part, VideoPart) for part in parts)
        kinds = f"{IMAGE_MARKER} / {VIDEO_MARKER}" if videos else IMAGE_MARKER
        raise PromptError(f"the {where} has {len(markers)} {kinds} markers but {given}. Put one marker where each "
                          "image or video goes, or remove all markers to place them before the text.")
    for place, (marker, part) in enumerate(zip(markers, parts), start=1):
        expected = VIDEO_MARKER if isinstance(part, VideoPart) else IMAGE_MARKER
        if marker != expected:
            given_kind = "a video" if isinstance(part, VideoPart) else "an image"
            raise PromptError(f"the {where}'s marker {place} is {marker}, but item {place} given for it is "
                              f"{given_kind}. Write {IMAGE_MARKER} where an image goes and {VIDEO_MARKER} where a "
                              "video goes, in the order the images and videos are given.")
    pieces = _MARKERS.split(text)
    return (pieces[0], *(part for item, piece in zip(parts, pieces[1:]) for part in (item, piece)))


def pads_in(text: str) -> list[str]:
    """The image and video pads of a rendered prompt, in order."""
    return _PADS.findall(text)


def pads_for(counts: Sequence[MediaTokens]) -> list[str]:
    """The pads a chat template writes for these images and videos, in order."""
    return [VIDEO_PAD if isinstance(count, VideoTokens) else IMAGE_PAD for count in counts]


def tokenize(tokenizer: Tokenizer, text: str, counts: tuple[MediaTokens, ...]) -> list[int]:
    """Token ids of a rendered prompt holding one IMAGE_PAD per image and one VIDEO_PAD per video, in the order of
    `counts` (the caller checked: pads_in(text) == pads_for(counts)): an image's pad written out as its number of
    pads, a video's as its frame groups."""
    chunks = _PADS.split(text)
    ids = tokenizer.encode(chunks[0])
    for count, chunk in zip(counts, chunks[1:]):
        if isinstance(count, VideoTokens):
            for seconds in count.timestamps:
                ids += tokenizer.encode(f"<{seconds:.1f} seconds><|vision_start|>")
                ids += [tokenizer.token_id(VIDEO_PAD)] * count.group_tokens + [tokenizer.token_id("<|vision_end|>")]
        else:
            ids += [tokenizer.token_id(IMAGE_PAD)] * count
        ids += tokenizer.encode(chunk)
    return ids
