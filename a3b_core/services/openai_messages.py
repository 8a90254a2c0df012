"""OpenAI chat messages <-> the conversation A3BModel.build_prompt takes (a system message, earlier turns, the user
text with [[IMG]] where each image goes, and the images in order).

The server reads a request's messages into build_prompt's arguments, so its prompt is the one Qwen's chat template
renders from those messages. The remote client writes an A3B Prompt's conversation as messages, so a remote server
that renders them gets the prompt a local model builds. Images travel as `image_url` parts; a user text keeps its
place between its images, and a text without [[IMG]] markers follows its images, as in build_prompt.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .. import IMAGE_MARKER, VIDEO_MARKER, PromptError, Turn


@dataclass(frozen=True)
class Conversation:
    user: str  # the last user message, [[IMG]] where each of its images goes
    system: str = ""
    history: tuple[Turn, ...] = ()
    image_urls: tuple[str, ...] = ()  # every image of the conversation in order, the earlier turns' first
    image_places: tuple[str, ...] = ()  # where each image was in the request, for error messages


# ------------------------------------------------------------------------------------------ messages -> conversation
def conversation_from_messages(messages: object) -> Conversation:
    """A request's `messages`: an optional system message, then user and assistant messages taking turns, ending with
    a user message. User content is a string or a list of `text` and `image_url` parts."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list of {role, content} objects; pass at least the user "
                          "message the model answers.")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PromptError(f"messages[{index}] is of type {type(message).__name__}; write each message as an "
                              "object with 'role' and 'content'.")
        if message.get("tool_calls"):
            raise PromptError(f"messages[{index}] holds tool_calls, but this server does not support tools. Remove "
                              "them and use plain text messages.")
    system = ""
    first = 0
    if messages[0].get("role") == "system":
        system = _text_only(messages[0].get("content"), "messages[0]")
        first = 1
    urls: list[str] = []
    places: list[str] = []
    texts: list[str] = []
    turns: list[Turn] = []
    for index in range(first, len(messages)):
        message, where = messages[index], f"messages[{index}]"
        expected = "user" if (index - first) % 2 == 0 else "assistant"
        role = message.get("role")
        if role != expected:
            raise PromptError(f"{where} has role {role!r} where a {expected!r} message belongs. Put an optional "
                              "system message first, then user and assistant messages taking turns, ending with a "
                              "user message.")
        if role == "user":
            text, images = _user_content(message.get("content"), where)
            texts.append(text)
            urls += [url for url, _ in images]
            places += [place for _, place in images]
        else:
            reasoning = message.get("reasoning_content", message.get("reasoning"))
            turns.append(Turn(user=texts[-1], assistant=_text_only(message.get("content"), where),
                              reasoning=reasoning if isinstance(reasoning, str) else "",
                              num_images=texts[-1].count(IMAGE_MARKER)))
    if messages[-1].get("role") != "user":
        raise PromptError(f"messages[{len(messages) - 1}] is not a user message; put the user message the model "
                          "answers last.")
    return Conversation(texts[-1], system, tuple(turns), tuple(urls), tuple(places))


def _user_content(content: object, where: str) -> tuple[str, list[tuple[str, str]]]:
    """The text with [[IMG]] in each image's place, and the (url, place) of each image."""
    if isinstance(content, str):
        return _plain_text(content, where), []
    if not isinstance(content, list):
        raise PromptError(f"{where}.content is of type {type(content).__name__}; use a string or a list of 'text' "
                          "and 'image_url' parts.")
    text, images = "", []
    for index, part in enumerate(content):
        place = f"{where}.content[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text += _plain_text(part.get("text"), place)
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise PromptError(f"{place}.image_url has no url; give it {{'url': 'data:image/png;base64,...'}}.")
            text += IMAGE_MARKER
            images.append((url, f"{place}.image_url"))
        else:
            raise PromptError(f"{place} is of type {kind!r}; use only 'text' and 'image_url' parts.")
    return text, images


def _plain_text(text: object, where: str) -> str:
    if not isinstance(text, str):
        raise PromptError(f"{where} text is of type {type(text).__name__}; use a string.")
    if IMAGE_MARKER in text:
        raise PromptError(f"{where} contains {IMAGE_MARKER}, which this server reserves for image places. Send images "
                          "as image_url parts and remove the marker from the text.")
    if VIDEO_MARKER in text:
        raise PromptError(f"{where} contains {VIDEO_MARKER}, which this server reserves for video places, and it takes "
                          "no videos. Remove the marker from the text.")
    return text


def _text_only(content: object, where: str) -> str:
    """System and assistant content: a string (None for none) or a list of text parts, joined."""
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise PromptError(f"{where}.content[{index}] is not a text part; remove it (system and assistant "
                                  "messages hold only text).")
            parts.append(_plain_text(part.get("text"), f"{where}.content[{index}]"))
        return "".join(parts)
    return _plain_text(content, f"{where}.content")


# ------------------------------------------------------------------------------------------ conversation -> messages
def messages_from_conversation(user: str, system: str | None = None, history: Sequence[Turn] = (),
                               image_urls: Sequence[str] = ()) -> list[dict]:
    """The messages for build_prompt's arguments: `image_urls` lists the earlier turns' images first (num_images each),
    then the images of `user`."""
    history_images = sum(turn.num_images for turn in history)
    if history_images > len(image_urls):
        raise PromptError(f"history turns reference {history_images} images but only {len(image_urls)} were given. "
                          "Pass the earlier turns' images first, then the images of the current user text.")
    messages = [{"role": "system", "content": system}] if system and system.strip() else []
    used = 0
    for number, turn in enumerate(history, start=1):
        images = list(image_urls[used:used + turn.num_images])
        used += turn.num_images
        messages.append({"role": "user", "content": _content(turn.user, images, f"history turn {number} user text")})
        answer = {"role": "assistant", "content": turn.assistant}
        messages.append(answer | ({"reasoning_content": turn.reasoning} if turn.reasoning else {}))
    messages.append({"role": "user", "content": _content(user, list(image_urls[used:]), "user text")})
    return messages


def _content(text: str, image_urls: list[str], where: str) -> str | list[dict]:
    """A user text as message content: the plain string without images, else text and image parts in order."""
    if not image_urls:
        if IMAGE_MARKER in text:
            raise PromptError(f"the {where} has {text.count(IMAGE_MARKER)} {IMAGE_MARKER} markers but no image was "
                              "given. Connect the images, or remove the markers.")
        return text
    markers = text.count(IMAGE_MARKER)
    if markers == 0:
        pieces = [""] * len(image_urls) + [text]  # no marker: the images come before the text
    elif markers != len(image_urls):
        raise PromptError(f"the {where} has {markers} {IMAGE_MARKER} markers but {len(image_urls)} images were "
                          "given. Put one marker where each image goes, or remove all markers to place the images "
                          "before the text.")
    else:
        pieces = text.split(IMAGE_MARKER)
    parts = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
    for url, piece in zip(image_urls, pieces[1:]):
        parts.append({"type": "image_url", "image_url": {"url": url}})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts
