"""The model folder's own chat template (chat_template.jinja, or the "chat_template" of chat_template.json or
tokenizer_config.json), rendered in a sandbox.

Every released Qwen model folder ships its template, and fine-tunes edit it, so a folder's template is what the model
was trained to read. A template is untrusted text: it is compiled once, at load, in jinja2's immutable sandbox (no
attribute starting with an underscore, no method that changes a list or dict), with the helpers Qwen's templates use
(raise_exception, tojson, loop controls). Rendering is bounded: range() is capped by the sandbox, every loop, call and
attribute read checks the CPU time spent, the strings, lists and numbers a template builds are capped in size, and
recursion ends in an error. Every failure is a ChatTemplateError naming the file and pointing at the built-in
template.
"""
from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .config import inside_folder
from .errors import ChatTemplateError
from .options import BUILT_IN_TEMPLATE
from .prompt import (IMAGE_PAD, VIDEO_PAD, ImagePart, MediaTokens, Message, Prompt, Turn, VideoPart, conversation,
                     pads_for, pads_in, tokenize)
from .tokenizer import Tokenizer

TEMPLATE_FILE = "chat_template.jinja"
JSON_FILES = ("chat_template.json", "tokenizer_config.json")  # files whose "chat_template" field may hold it
MAX_FILE_BYTES = 8 * 2**20  # released templates are about 10 KiB, tokenizer_config.json files under 1 MiB
MAX_TEXT = 16 * 2**20  # characters of a string a template builds, and of the prompt it renders
MAX_ITEMS = 2**20  # items of a list, tuple or dict a template builds
MAX_INT_BITS = 4096  # a template counts images and turns; it never needs numbers near this size
# CPU seconds of the rendering thread (so a busy machine cannot make a good template fail); a typical prompt renders
# in about a millisecond
RENDER_SECONDS = 2.0
_FALLBACK = (f'choose chat_template "{BUILT_IN_TEMPLATE}" on the loader (load_model(..., chat_template='
             f'"{BUILT_IN_TEMPLATE}")) to use the built-in template')
# A width or precision that could make a huge string: "%*d", "%099999d", "%.99999f"; "{:99999}", "{0:.99999}".
_WIDE_PERCENT = re.compile(r"%[-#0 +]*(\*|\d{5,}|\d*\.(\*|\d{5,}))")
_WIDE_FIELD = re.compile(r"\{[^{}]*:[^{}]*\d{5,}")

# What a template's own expressions can raise, besides jinja2's errors and the limits here.
_TEMPLATE_FAILURES = (jinja2.TemplateError, RecursionError, MemoryError, ArithmeticError, TypeError, ValueError,
                      LookupError, AttributeError)

_deadline: ContextVar[float] = ContextVar("a3b_chat_template_deadline", default=float("inf"))  # in thread_time()


class TemplateLimitError(jinja2.TemplateError):
    """A template went past a limit on time or size."""


class RaisedByTemplate(jinja2.TemplateError):
    """The template called raise_exception."""


class FolderTemplate:
    """A model folder's chat template, compiled once; `build_prompt` works as a family's built-in one does."""

    def __init__(self, source: str, path: Path, name: str):
        self.path = path  # the file, for messages
        self.name = name  # where in the folder it came from, as the loader reports it
        try:
            self.template = _ENVIRONMENT.from_string(_guard_loops(_ENVIRONMENT.parse(source)))
        except _TEMPLATE_FAILURES as exc:  # compiling folds constant expressions, so it can fail as rendering does
            raise self._error(f"cannot be compiled ({_reason(exc)})") from None

    @property
    def in_use(self) -> str:
        return f"model folder: {self.name}"

    def build_prompt(self, tokenizer: Tokenizer, user: str, *, system: str | None = None,
                     image_token_counts: Sequence[MediaTokens] = (), thinking: bool = False,
                     history: Sequence[Turn] = (), add_vision_id: bool = False) -> Prompt:
        """The conversation (see prompt.conversation) rendered by this template and tokenized, each image's pad
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
        token = _deadline.set(time.thread_time() + RENDER_SECONDS)
        switch = {} if thinking is None else {"enable_thinking": thinking}
        try:
            chunks, size = [], 0
            for chunk in self.template.generate(messages=messages, add_generation_prompt=True,
                                                add_vision_id=add_vision_id, **switch):
                size += len(chunk)
                if size > MAX_TEXT:
                    raise TemplateLimitError(f"the prompt grew past {MAX_TEXT} characters")
                chunks.append(chunk)
                _check_deadline()
            return "".join(chunks)
        except RaisedByTemplate as exc:
            raise self._error(f"refused the prompt: {exc.message}") from None
        except _TEMPLATE_FAILURES as exc:
            raise self._error(f"cannot be rendered ({_reason(exc)})") from None
        finally:
            _deadline.reset(token)

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


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "it recurses without end"
    if isinstance(exc, MemoryError):
        return "it ran out of memory"
    where = f"line {exc.lineno}: " if isinstance(exc, jinja2.TemplateSyntaxError) and exc.lineno else ""
    return f"{where}{type(exc).__name__}: {exc}"[:500]


# ------------------------------------------------------------------------------------------------ the sandbox
def _check_deadline() -> None:
    if time.thread_time() > _deadline.get():
        raise TemplateLimitError(f"rendering took over {RENDER_SECONDS:g} s of CPU time")


def _checked(value: Any) -> Any:
    """`value`, refused if it is a string, collection or number larger than any prompt needs."""
    if isinstance(value, str):
        if len(value) > MAX_TEXT:
            raise TemplateLimitError(f"a string grew past {MAX_TEXT} characters")
    elif isinstance(value, (list, tuple, dict)):
        if len(value) > MAX_ITEMS:
            raise TemplateLimitError(f"a list grew past {MAX_ITEMS} items")
    elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"a number grew past {MAX_INT_BITS} bits")
    return value


def _checked_arguments(args: Iterable[Any]) -> None:
    """Refuses a size argument (a width, a repeat count) that would build a string larger than any prompt."""
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > MAX_TEXT:
            raise TemplateLimitError(f"the argument {arg} is larger than any prompt needs")
        _checked(arg)


class _LoopGuard(Extension):
    """Holds the function every `for` loop of a compiled template iterates through (see _guard_loops). Reached through
    the environment's extensions, so a template cannot shadow it."""

    @staticmethod
    def guarded(items: Iterable[Any]) -> Iterator[Any]:
        for item in items:
            _check_deadline()
            yield item


def _guard_loops(template: nodes.Template) -> nodes.Template:
    """The parsed template with each `for` loop iterating through _LoopGuard.guarded, so loops that call nothing still
    check the deadline."""
    for loop in template.find_all(nodes.For):
        guard = nodes.ExtensionAttribute(_LoopGuard.identifier, "guarded", lineno=loop.lineno)
        loop.iter = nodes.Call(guard, [loop.iter], [], None, None, lineno=loop.lineno)
    return template


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, where an unsafe attribute is an error (not an empty value), and calls, attribute
    reads and the operators that can build large values are checked against the limits."""

    intercepted_binops = frozenset(("*", "**", "+", "%"))

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja2's names)
        _check_deadline()
        _checked_arguments((*args, *kwargs.values()))
        return _checked(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_deadline()
        return _checked(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_deadline()
        return _checked(super().getitem(obj, argument))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None and _WIDE_FIELD.search(value.__self__):
            raise TemplateLimitError("a format string asks for a width larger than any prompt needs")
        return wrapped

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*" and isinstance(left, int) != isinstance(right, int):  # repeating a string or list
            count, repeated = (left, right) if isinstance(left, int) else (right, left)
            limit = MAX_TEXT if isinstance(repeated, str) else MAX_ITEMS
            if isinstance(repeated, (str, list, tuple)) and count * len(repeated) > limit:
                raise TemplateLimitError(f"repeating a {type(repeated).__name__} {count} times is larger than any "
                                         "prompt needs")
        elif operator == "*" and isinstance(left, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(f"a number grew past {MAX_INT_BITS} bits")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right * left.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError(f"{left} ** {right} is larger than any prompt needs")
        elif operator == "%" and isinstance(left, str) and _WIDE_PERCENT.search(left):
            raise TemplateLimitError("a format string asks for a width larger than any prompt needs")
        return _checked(super().call_binop(context, operator, left, right))


def _raise_exception(message: Any) -> None:
    raise RaisedByTemplate(str(message))


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, separators: Any = None,
            sort_keys: bool = False) -> str:
    """JSON as chat templates expect it (tool schemas, call arguments): not HTML-escaped, Unicode kept."""
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys,
                      separators=tuple(separators) if separators is not None else None)


def _guarded_filter(function: Callable[..., Any]) -> Callable[..., Any]:
    """A filter whose size arguments (center(width), indent(width), ...) and result are checked; filters are called
    directly by compiled templates, not through the sandbox's call."""
    @functools.wraps(function)  # keeps jinja2's pass_context/pass_environment marks
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        _checked_arguments((*args[1:], *kwargs.values()))
        return _checked(function(*args, **kwargs))
    return guarded


def _environment() -> _Sandbox:
    # trim_blocks and lstrip_blocks: the whitespace handling Qwen's templates are written for.
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, autoescape=False,
                   extensions=["jinja2.ext.loopcontrols", _LoopGuard])
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    env.filters = {name: _guarded_filter(function) for name, function in env.filters.items()}
    return env


_ENVIRONMENT = _environment()
