"""The model folder's own chat template (chat_template.jinja, or the "chat_template" of chat_template.json or
tokenizer_config.json), rendered in the sandbox of template_sandbox.py.

Every released Qwen model folder ships its template, and fine-tunes edit it, so a folder's template is what the model
was trained to read. A template is untrusted text: it is compiled once, at load, in the sandbox, which bounds the time
and the memory each render may take. The prompt may be at most twice the conversation's text plus PROMPT_EXTRA
characters (so tokenizing it costs about what the conversation does), and a template MAX_TEMPLATE_CHARACTERS (so
compiling it is quick). Every failure is a ChatTemplateError naming the file and pointing at the built-in template.
"""
from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ChatTemplateError
from ..release.config import inside_folder
from .conversation import (IMAGE_PAD, VIDEO_PAD, ImagePart, MediaTokens, Message, Prompt, Turn, VideoPart, conversation,
                           pads_for, pads_in, tokenize)
from .template_costs import MAX_TEXT, TemplateLimitError, allowance
from .template_sandbox import TEMPLATE_FAILURES, RaisedByTemplate, compile_template, failure_reason
from .tokenizer import Tokenizer

# "auto": the model folder's own chat template when it has one, else the family's built-in one; "built-in": always it
BUILT_IN_TEMPLATE = "built-in"
CHAT_TEMPLATES = ("auto", BUILT_IN_TEMPLATE)
TEMPLATE_FILE = "chat_template.jinja"
JSON_FILES = ("chat_template.json", "tokenizer_config.json")  # files whose "chat_template" field may hold it
MAX_FILE_BYTES = 8 * 2**20  # released templates are about 10 KiB, tokenizer_config.json files under 1 MiB
# Characters of a template: compiling the worst this long takes about 1 s of CPU and 120 MB (8 MiB: 120 s, 16 GB).
MAX_TEMPLATE_CHARACTERS = 64 * 2**10
# Characters a prompt may have beyond twice its conversation's texts (the template's own words, a default system
# prompt, image pads): so tokenizing it is about the work the conversation itself asks for (1 Mi characters take the
# tokenizer about 0.8 s and 250 MB).
PROMPT_EXTRA = 2**18
_FALLBACK = (f'choose chat_template "{BUILT_IN_TEMPLATE}" on the loader (load_model(..., chat_template='
             f'"{BUILT_IN_TEMPLATE}")) to use the built-in template')


class FolderTemplate:
    """A model folder's chat template, compiled once; `build_prompt` works as a family's built-in one does."""

    def __init__(self, source: str, path: Path, name: str):
        self.path = path  # the file, for messages
        self.name = name  # where in the folder it came from, as the loader reports it
        if len(source) > MAX_TEMPLATE_CHARACTERS:
            raise self._error(f"is {len(source)} characters long, over the {MAX_TEMPLATE_CHARACTERS} one may have "
                              "(released templates are about 10,000)")
        try:
            self.template = compile_template(source)
        except TEMPLATE_FAILURES as exc:
            raise self._error(f"cannot be compiled ({failure_reason(exc)})") from None

    @property
    def in_use(self) -> str:
        return f"model folder: {self.name}"

    def build_prompt(self, tokenizer: Tokenizer, user: str, *, system: str | None = None,
                     image_token_counts: Sequence[MediaTokens] = (), thinking: bool = False,
                     history: Sequence[Turn] = (), add_vision_id: bool = False) -> Prompt:
        """The conversation (see conversation.conversation) rendered by this template and tokenized, each image's pad
        written out to its number of LM tokens and each video's to its timestamped frame groups."""
        chat = conversation(tokenizer, user, system=system, image_token_counts=image_token_counts, history=history)
        text = self.render([_as_template_message(message) for message in chat.messages], thinking, add_vision_id)
        written, expected = pads_in(text), pads_for(chat.image_token_counts)
        if written != expected:
            wrote = (f"wrote {written.count(IMAGE_PAD)} image placeholders ({IMAGE_PAD}) for "
                     f"{expected.count(IMAGE_PAD)} images")
            if VIDEO_PAD in written + expected:
                wrote += (f" and {written.count(VIDEO_PAD)} video placeholders ({VIDEO_PAD}) for "
                          f"{expected.count(VIDEO_PAD)} videos, in the order {written}")
            raise self._error(f"{wrote}; a template for this model must write one where each image or video goes, "
                              "in order")
        return Prompt(tuple(tokenize(tokenizer, text, chat.image_token_counts)), chat.image_token_counts, thinking,
                      text)

    def default_thinking(self) -> bool | None:
        """Whether the template thinks when enable_thinking is not given (Qwen3.5/3.6's do): its generation prompt
        for a plain request then opens a think block without closing it. None when that prompt cannot be
        rendered."""
        try:
            text = self.render([{"role": "user", "content": "Hello."}], None, False)
        except ChatTemplateError:
            return None
        opening = text.rpartition("<|im_start|>assistant")[2]
        return "<think>" in opening and "</think>" not in opening

    def render(self, messages: list[dict], thinking: bool | None, add_vision_id: bool) -> str:
        """The template's text for `messages`, ending with the generation prompt; `thinking` None leaves
        enable_thinking undefined, so the template's own default applies."""
        switch = {} if thinking is None else {"enable_thinking": thinking}
        characters = _characters(messages)
        longest = min(MAX_TEXT, 2 * characters + PROMPT_EXTRA)
        try:
            with allowance(characters):
                text, size = io.StringIO(), 0  # one growing buffer, not a list of every small chunk
                for chunk in self.template.generate(messages=messages, add_generation_prompt=True,
                                                    add_vision_id=add_vision_id, **switch):
                    size += len(chunk)
                    if size > longest:
                        raise TemplateLimitError(f"the prompt grew past {longest} characters (twice the "
                                                 f"conversation's texts and {PROMPT_EXTRA} more)")
                    text.write(chunk)
                return text.getvalue()
        except RaisedByTemplate as exc:
            raise self._error(f"refused the prompt: {exc.message}") from None
        except TEMPLATE_FAILURES as exc:
            raise self._error(f"cannot be rendered ({failure_reason(exc)})") from None

    def _error(self, problem: str) -> ChatTemplateError:
        return ChatTemplateError(f"{self.path}: the model folder's chat template {problem}. Fix the template, or "
                                 f"{_FALLBACK}.")


def find_chat_template(folder: Path) -> FolderTemplate | None:
    """The folder's chat template, compiled (see template_source); None when it has none."""
    found = template_source(folder)
    return FolderTemplate(*found) if found is not None else None


def template_source(folder: Path) -> tuple[str, Path, str] | None:
    """The text of the folder's chat template, its file, and where in the folder it came from: chat_template.jinja,
    else the "chat_template" of chat_template.json (the processor's file), else of tokenizer_config.json (a string,
    or a list of {name, template} whose "default" entry is the chat template); None when it has none."""
    path = folder / TEMPLATE_FILE
    if path.is_file():
        return _read_text(folder, path), path, TEMPLATE_FILE
    for name in JSON_FILES:
        path = folder / name
        if path.is_file():
            source = _json_template(folder, path)
            if source is not None:
                return source, path, f"{name} (chat_template)"
    return None


def _json_template(folder: Path, path: Path) -> str | None:
    try:
        raw = json.loads(_read_text(folder, path))
    except (ValueError, RecursionError) as exc:
        raise ChatTemplateError(f"{path}: cannot be parsed as JSON ({exc}). Re-download it, or {_FALLBACK}.") from None
    source = raw.get("chat_template") if isinstance(raw, dict) else None
    if isinstance(source, list):
        named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
        source = named.get("default")
    if source is not None and not isinstance(source, str):
        raise ChatTemplateError(f"{path}: 'chat_template' is a {type(source).__name__}; expected the template's text "
                                f"(or a list of {{name, template}} with a 'default' entry). Re-download it, or "
                                f"{_FALLBACK}.")
    return source


def _read_text(folder: Path, path: Path) -> str:
    resolved = inside_folder(folder, path, ChatTemplateError)
    try:
        if resolved.stat().st_size > MAX_FILE_BYTES:
            raise ChatTemplateError(f"{path}: is over {MAX_FILE_BYTES // 2**20} MiB, far larger than any chat "
                                    f"template. Replace it with the file from the model's release, or {_FALLBACK}.")
        return resolved.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"{path}: cannot be read as UTF-8 text ({exc}). Re-download it, or "
                                f"{_FALLBACK}.") from None


def _as_template_message(message: Message) -> dict:
    """A message as chat templates take it (the OpenAI form transformers passes): text content as a string, content
    with images or videos as a list of {"type": "text", "text"}, {"type": "image"} and {"type": "video"} parts;
    reasoning as reasoning_content."""
    if any(not isinstance(part, str) for part in message.parts):
        kinds = {ImagePart: "image", VideoPart: "video"}
        content: Any = [{"type": "text", "text": part} if isinstance(part, str) else {"type": kinds[type(part)]}
                        for part in message.parts if part != ""]
    else:
        content = "".join(message.parts)
    return {"role": message.role, "content": content} | (
        {"reasoning_content": message.reasoning} if message.reasoning else {})


def _characters(messages: list[dict]) -> int:
    """The characters of a conversation's texts: contents, their text parts, and reasoning."""
    total = 0
    for message in messages:
        content = message["content"]
        texts = [content] if isinstance(content, str) else [part.get("text", "") for part in content]
        total += sum(map(len, texts)) + len(message.get("reasoning_content", ""))
    return total
