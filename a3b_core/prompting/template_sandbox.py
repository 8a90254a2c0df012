"""The sandbox chat templates are compiled and rendered in: jinja2's immutable sandbox (no attribute starting with an
underscore, no method that changes a list or dict), with the helpers Qwen's templates use (raise_exception, tojson,
loop controls).

Rendering is bounded before the work is done: every step that builds a string or a list (operators, filters, str
methods, formatting, slicing, literals, calls, output) computes the size of its result from its operands first, and is
refused past the caps on one value (MAX_TEXT, MAX_ITEMS, MAX_INT_BITS) or on all that a render builds (MAX_BUILT, plus
BUILT_PER_CHARACTER per character of the conversation); loop steps, calls, attribute reads and operations check the CPU
time spent, and no single step the caps allow runs long past it; recursion ends in an error. compile_template compiles
a template with these guards; each render runs within an `allowance`.
"""
from __future__ import annotations

import functools
import inspect
import io
import itertools
import json
import re
import reprlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, ValuesView
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import BuiltinMethodType, GeneratorType
from typing import Any

import jinja2
import markupsafe
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter, SecurityError
from jinja2.utils import Namespace, missing
from jinja2.visitor import NodeTransformer

MAX_TEXT = 16 * 2**20  # characters of one string a template builds, and of the prompt it renders
MAX_ITEMS = 2**17  # items of one list, tuple or dict a template builds (the sort filter takes about 0.5 s on this many)
MAX_WORD_TEXT = 2**17  # characters a filter that runs Python code per word takes (wordwrap: about 0.06 s)
MAX_INT_BITS = 4096  # a template counts images and turns; it never needs numbers near this size
MAX_ROUND_DIGITS = 400  # round's precision (a float has at most 309 digits before its point)
MAX_NAME = 256  # characters of a filter, test or attribute name given to a filter (jinja2 splits and quotes them)
# What one render may build in all, in bytes as _text and _items count them: a base, and more per character of the
# conversation, which Qwen's templates copy about 7 times (so a prompt of MAX_TEXT characters still renders).
MAX_BUILT = 32 * 2**20
BUILT_PER_CHARACTER = 16
VALUE_BYTES = 64  # counted for each value built: a string's or list's header, or an item's pointer and small object
# CPU seconds of the rendering thread (so a busy machine cannot make a good template fail); a typical prompt renders
# in about a millisecond
RENDER_SECONDS = 2.0

# What a template's own expressions can raise, besides jinja2's errors and the limits here (truncate asserts).
TEMPLATE_FAILURES = (jinja2.TemplateError, RecursionError, MemoryError, ArithmeticError, TypeError, ValueError,
                     LookupError, AttributeError, AssertionError)


class TemplateLimitError(jinja2.TemplateError):
    """A template went past a limit on time or size."""


class RaisedByTemplate(jinja2.TemplateError):
    """The template called raise_exception."""


def failure_reason(exc: BaseException) -> str:
    """Why a template failed to compile or render, in a few words (at most 500 characters)."""
    if isinstance(exc, RecursionError):
        return "it recurses without end"
    if isinstance(exc, MemoryError):
        return "it ran out of memory"
    if isinstance(exc, jinja2.TemplateSyntaxError):  # its str() adds the line again
        detail = f"line {exc.lineno}: {type(exc).__name__}: {exc.message}" if exc.lineno else exc.message
    elif isinstance(exc, KeyError) and exc.args:  # its str() is its key's repr, as long as any string built
        detail = f"KeyError: {reprlib.repr(exc.args[0])}"
    else:
        detail = f"{type(exc).__name__}: {exc}"
    return detail[:500]


# ------------------------------------------------------------------------------------------------ the allowance
_TOO_LONG = f"a string would grow past {MAX_TEXT} characters"


@dataclass
class _Allowance:
    """What the render (or compile) under way may still spend."""
    deadline: float  # in thread_time()
    total: int  # bytes of values it may build, as _text and _items count them
    left: int


_ALLOWANCE: ContextVar[_Allowance] = ContextVar("a3b_chat_template_allowance")


@contextmanager
def allowance(characters: int) -> Iterator[None]:
    """What a render of a conversation of `characters` may spend while the block runs: RENDER_SECONDS of CPU time
    and MAX_BUILT bytes, plus BUILT_PER_CHARACTER per character."""
    total = MAX_BUILT + BUILT_PER_CHARACTER * characters
    token = _ALLOWANCE.set(_Allowance(time.thread_time() + RENDER_SECONDS, total, total))
    try:
        yield
    finally:
        _ALLOWANCE.reset(token)


def _tick() -> None:
    if time.thread_time() > _ALLOWANCE.get().deadline:
        raise TemplateLimitError(f"rendering took over {RENDER_SECONDS:g} s of CPU time")


def _spend(cost: int) -> None:
    """Called before building values that cost `cost` bytes: refuses them past the allowance, else takes them off."""
    _tick()
    allowance = _ALLOWANCE.get()
    if cost > allowance.left:
        raise TemplateLimitError(f"it built over {allowance.total // 2**20} MiB of strings and lists, more than one "
                                 "render of this conversation may")
    allowance.left -= cost


def _text(characters: int) -> int:
    """The cost of a string of `characters`; refuses one longer than MAX_TEXT."""
    if characters > MAX_TEXT:
        raise TemplateLimitError(_TOO_LONG)
    return VALUE_BYTES + max(characters, 0)


def _items(count: int) -> int:
    """The cost of a list of `count` items (each may be a new small object); refuses one longer than MAX_ITEMS."""
    if count > MAX_ITEMS:
        raise TemplateLimitError(f"a list would grow past {MAX_ITEMS} items")
    return VALUE_BYTES * (max(count, 0) + 1)


def _number(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"a number grew past {MAX_INT_BITS} bits")
    return value


# ------------------------------------------------------------------------------------------------ sizes
def _quoted_size(text: str) -> int:
    """An upper bound on the characters of repr(text) or of its JSON: an escape takes up to 12 characters."""
    plain = text.isascii() and text.isprintable() and not any(mark in text for mark in "'\"\\")
    return len(text) + 2 if plain else 12 * len(text) + 2


def _members(value: Any) -> Sequence[Any] | None:
    """What a container's text is written from: a list's, tuple's or set's items, a dict's keys and values (a
    namespace's attributes); None for any other value."""
    if isinstance(value, Namespace):
        value = value._Namespace__attrs  # the one attribute a namespace lets out, and what its repr writes
    if isinstance(value, Mapping):
        return [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple)):
        return value
    if isinstance(value, (AbstractSet, ValuesView)):  # sets, and a dict's keys, values and (key, value) items
        return list(value)
    return None


def _text_size(value: Any, quoted: bool = False, separators: int = 2, indent: int = 0) -> int:
    """An upper bound on the characters of `value` as text: str() of it, repr() when `quoted`, or its JSON with
    `separators` characters between items and `indent` more per level. A container is written with its members quoted;
    any other object has a short repr. Walked only until the bound passes MAX_TEXT, so a list holding one long string
    many times is no slower to measure than one that long."""
    if isinstance(value, str) and not quoted:  # the common case, measured often
        return len(value)
    size, pending, visited = 0, [(value, quoted, 0)], 0
    while pending and size <= MAX_TEXT:
        item, as_repr, depth = pending.pop()
        visited += 1
        if visited % 4096 == 0:
            _tick()
        if isinstance(item, str):
            size += _quoted_size(item) if as_repr else len(item)
        elif isinstance(item, bool) or item is None:
            size += 5
        elif isinstance(item, int):
            size += item.bit_length() * 10 // 33 + 2  # decimal digits (log10(2) < 10/33) and a sign
        elif isinstance(item, float):
            size += 25
        elif (members := _members(item)) is not None:
            size += 16 + len(members) * (separators + 1 + indent * (depth + 1))  # brackets, a type's name; newlines
            pending.extend((member, True, depth + 1) for member in members)
        else:
            size += len(repr(item))
    return size


def _total_size(items: Iterable[Any]) -> int:
    """The sum of the items' text sizes (see _text_size), counted until it passes MAX_TEXT."""
    if isinstance(items, str):
        return len(items)
    total = 0
    for item in items:
        total += _text_size(item)
        if total > MAX_TEXT:
            break
    return total


_NUMBER_CHARS = 440  # a float written out in full ('%f' of 1e308: 309 digits), with grouping, sign and point
# Python's format spec: [[fill]align][sign][z][#][0][width][grouping][.precision][type]
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?[bcdeEfFgGnosxX%]?", re.DOTALL)
# printf-style: %[(key)][flags][width][.precision][length]type
_PERCENT_FIELD = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?(.)", re.DOTALL)


def _field_size(value: Any, width: int, precision: int, quoted: bool = False) -> int:
    """An upper bound on the characters of one formatted field: `value` as text (its repr when `quoted`) or in any
    number format (an int in binary is the longest), padded to `width`."""
    if isinstance(value, (int, float)) and not quoted:
        size = _NUMBER_CHARS + (2 * value.bit_length() if isinstance(value, int) else 0)
    else:
        size = _text_size(value, quoted)
    return abs(width) + abs(precision) + size


def _percent_size(template: str, values: Any) -> int:
    """An upper bound on the characters of `template % values`, each '*' width or precision read from the values."""
    positional = iter(values if isinstance(values, tuple) else (values,))
    size = len(template)
    for number, field in enumerate(_PERCENT_FIELD.finditer(template)):
        key, width, precision, conversion = field.groups(default="")
        if number % 4096 == 0:
            _tick()
        if conversion == "%":
            continue
        if size > MAX_TEXT:
            break
        if "(" in key:  # Python reads nested parentheses in a key, which this pattern does not
            raise TemplateLimitError(f"the format key {key[:40]!r} has a parenthesis")
        width = next(positional, 0) if width == "*" else int(width or 0)
        precision = next(positional, 0) if precision == "*" else int(precision or 0)
        value = values[key] if key else next(positional, None)
        size += _field_size(value, width, precision, quoted=conversion in "ra")
    return size


class _Formatter(SandboxedFormatter):
    """str.format in the sandbox: each field's size is bounded, with its nested width and precision resolved, before
    it is converted or formatted."""

    def __init__(self, environment: jinja2.Environment, template: str):
        super().__init__(environment)
        self.size = len(template)  # characters of the result so far: its literal text, then each field

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion is not None:  # !s, !r, !a
            _spend(_text(_text_size(value, quoted=conversion != "s")))
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> Any:
        spec = _FORMAT_SPEC.fullmatch(format_spec)
        if spec is None:
            raise TemplateLimitError(f"the format spec {format_spec[:40]!r} is not one of Python's")
        size = _field_size(value, *(int(number or 0) for number in spec.groups()))
        self.size += size
        if self.size > MAX_TEXT:
            raise TemplateLimitError(_TOO_LONG)
        _spend(_text(size) + size)  # the field's text, and its copy in the result
        return super().format_field(value, format_spec)


def _replaced_size(text: str, old: str, new: str, count: int | None) -> int:
    occurrences = len(text) + 1 if old == "" else text.count(old)
    if count is not None and count >= 0:
        occurrences = min(occurrences, count)
    return len(text) + occurrences * max(len(new) - len(old), 0)


def _line_count(text: str) -> int:
    """An upper bound on the line breaks splitlines() finds."""
    return sum(text.count(mark) for mark in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")


def _joined_cost(items: Any, separator: str) -> int:
    return _text(_total_size(items) + len(separator) * max(len(items) - 1, 0))


def _ordering_cost(items: Any) -> int:
    """Sorting, grouping, deduplicating or taking the least of `items`: a list of them, and the lower-cased copies of
    their text it compares (a case mapping is up to 3 characters). Bounding their text also bounds the comparing."""
    return _items(len(items)) + _text(3 * _total_size(items))


def _word_by_word(name: str, value: Any) -> int:
    """A filter that runs Python code per word or character: its text is capped (so it takes well under a second)
    and it may build a list of its words."""
    size = _text_size(value)
    if size > MAX_WORD_TEXT:
        raise TemplateLimitError(f"the {name} filter works word by word and takes at most {MAX_WORD_TEXT} characters")
    return _items(size)


def _failed_number_cost(value: Any) -> int:
    """float() of a text that is not a number writes the text's repr into its error."""
    return _text(_text_size(value, quoted=True)) if isinstance(value, str) else 0


def _rounding_cost(precision: int) -> int:
    if abs(precision) > MAX_ROUND_DIGITS:
        raise TemplateLimitError(f"round's precision {precision} is over {MAX_ROUND_DIGITS} digits")
    return 0


def _summing_cost(start: Any) -> int:
    """sum adds numbers only: adding lists would copy the growing list at every step."""
    if not isinstance(start, (int, float)):
        raise TemplateLimitError(f"the sum filter adds numbers; its start is a {type(start).__name__}")
    return 0


def _indented_cost(text: Any, width: int | str) -> int:
    """indent's copies: the text split into lines, each but the first behind the indentation."""
    lines = _line_count(text) + 1 if isinstance(text, str) else 1
    size = _text_size(text) + lines * (1 + (len(width) if isinstance(width, str) else width))
    return _items(lines) + 3 * _text(size)


def _names_cost(*names: Any) -> int:
    """Refuses a filter, test or attribute name longer than MAX_NAME: jinja2 splits one at each dot and quotes one it
    cannot find in its error."""
    if any(isinstance(name, str) and len(name) > MAX_NAME for name in names):
        raise TemplateLimitError(f"a filter, test or attribute name is over {MAX_NAME} characters")
    return 0


def _free(*_: Any, **__: Any) -> int:
    return 0


def _text_long(text: str, *_: Any) -> int:
    return _text(len(text))


def _case_changed(text: str) -> int:
    return _text(3 * len(text))


def _padded(text: str, width: int, fillchar: str = " ") -> int:
    return _text(max(len(text), width))


def _split_cost(text: str, sep: str | None = None, maxsplit: int = -1) -> int:
    pieces = len(text) // 2 + 1 if sep is None else text.count(sep) + 1
    if maxsplit >= 0:
        pieces = min(pieces, maxsplit + 1)
    return _items(pieces) + _text(len(text))


# The str methods a template may call, each with the cost of its result from its arguments (format and format_map go
# through _Formatter). Any other str method (encode, translate, ...) is refused.
_STR_METHODS: dict[str, Callable[..., int]] = {
    **dict.fromkeys(("capitalize", "casefold", "lower", "swapcase", "title", "upper"), _case_changed),
    **dict.fromkeys(("center", "ljust", "rjust", "zfill"), _padded),
    "expandtabs": lambda text, tabsize=8: _text(len(text) + text.count("\t") * max(tabsize, 0)),
    "join": lambda text, items: _joined_cost(items, text),
    "replace": lambda text, old, new, count=-1: _text(_replaced_size(text, old, new, count)),
    "split": _split_cost,
    "rsplit": _split_cost,
    "splitlines": lambda text, keepends=False: _items(_line_count(text) + 1) + _text(len(text)),
    **dict.fromkeys(("lstrip", "partition", "removeprefix", "removesuffix", "rpartition", "rstrip", "strip"),
                    _text_long),
    **dict.fromkeys(("count", "endswith", "find", "index", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit",
                     "isidentifier", "islower", "isnumeric", "isprintable", "isspace", "istitle", "isupper", "rfind",
                     "rindex", "startswith"), _free),
}
_CONTEXT_KEYWORDS = ("_loop_vars", "_block_vars")  # what compiled templates pass to every call, for jinja2's own use
# The methods a template may call on the conversation's values; no method of a number (int.to_bytes builds bytes of
# any length), nor list.index (its error quotes its argument).
_METHODS = ((str, frozenset(_STR_METHODS)), (dict, frozenset(("get", "items", "keys", "values"))),
            ((list, tuple), frozenset(("count",))), ((int, float), frozenset()))

# Each filter kept, with the cost of its result from its arguments (as jinja2's signature for it names them);
# filters not listed (urlize, pprint) are removed.
_FILTER_COSTS: dict[str, Callable[[dict[str, Any]], int]] = {
    # a number, an item, or a generator (read into a list, counted: see _materialized)
    **dict.fromkeys(("abs", "attr", "count", "d", "default", "first", "items", "last", "length", "random", "safe",
                     "tojson"), _free),  # safe, tojson: ours
    **dict.fromkeys(("map", "reject", "rejectattr", "select", "selectattr"),
                    lambda a: _names_cost(*a["args"][:1], a["kwargs"].get("attribute"))),
    "float": lambda a: _failed_number_cost(a["value"]),
    "int": lambda a: _failed_number_cost(a["value"]),
    "filesizeformat": lambda a: _failed_number_cost(a["value"]),
    "round": lambda a: _rounding_cost(a["precision"]),
    **dict.fromkeys(("capitalize", "lower", "upper"), lambda a: _text(3 * _text_size(a["s"]))),
    "title": lambda a: _word_by_word("title", a["s"]) + _text(3 * _text_size(a["s"])),
    "trim": lambda a: _text(_text_size(a["value"])),
    "string": lambda a: _text(_text_size(a["s"])),
    **dict.fromkeys(("e", "escape", "forceescape"), lambda a: _text(6 * _text_size(a["value"]))),
    "center": lambda a: _text(max(_text_size(a["value"]), a["width"])),
    "indent": lambda a: _indented_cost(a["s"], a["width"]),
    "truncate": lambda a: 3 * _text(min(_text_size(a["s"]), a["length"] + len(a["end"]))),
    "wordcount": lambda a: _word_by_word("wordcount", a["s"]),
    "wordwrap": lambda a: (_word_by_word("wordwrap", a["s"])
                           + _text(_text_size(a["s"]) * (1 + len(a["wrapstring"] or "\n")))),
    "striptags": lambda a: _word_by_word("striptags", a["value"]) + _text(_text_size(a["value"])),
    "urlencode": lambda a: _word_by_word("urlencode", a["value"]) + _text(12 * _text_size(a["value"])),
    "xmlattr": lambda a: _word_by_word("xmlattr", a["d"]) + _text(6 * _text_size(a["d"])),
    "replace": lambda a: _text(_replaced_size(*map(_as_text, (a["s"], a["old"], a["new"])), a["count"])),
    "format": lambda a: _text(_percent_size(_as_text(a["value"]), a["kwargs"] or a["args"])),
    "join": lambda a: _names_cost(a["attribute"]) + 2 * _joined_cost(a["value"], _as_text(a["d"])),  # items, result
    "list": lambda a: _items(len(a["value"])),
    "reverse": lambda a: _text(len(a["value"])) if isinstance(a["value"], str) else _items(len(a["value"])),
    "batch": lambda a: _items(len(a["value"])) + _items(a["linecount"]),
    "slice": lambda a: _items(len(a["value"])) + _items(a["slices"]),
    **dict.fromkeys(("max", "min", "sort", "unique"),
                    lambda a: _names_cost(a["attribute"]) + _ordering_cost(a["value"])),
    "dictsort": lambda a: _ordering_cost(a["value"].items()),
    "groupby": lambda a: _names_cost(a["attribute"]) + 2 * _ordering_cost(a["value"]),
    "sum": lambda a: _names_cost(a["attribute"]) + _summing_cost(a["start"]),
}


# ------------------------------------------------------------------------------------------------ bounded steps
def _as_text(value: Any) -> str:
    """str(value), its size bounded before it is built: what `{{ }}` writes, and jinja2's `safe` filter (no Markup
    here: autoescape is off)."""
    if isinstance(value, str):
        return value
    _spend(_text(_text_size(value)))
    return str(value)


def _concatenated(values: Iterable[Any]) -> str:
    """The values' text joined, its size bounded before it is built: `~`, and the output of a macro or block."""
    texts = [_as_text(value) for value in values]
    _spend(_text(sum(map(len, texts))))
    return "".join(texts)


class _Ticking:
    """An iterable's items, checking the deadline at each: what every `for` loop iterates through. It has the
    iterable's length, so loop.length and loop.revindex need not gather the items into a list."""

    def __init__(self, items: Iterable[Any]):
        self.items = items

    def __iter__(self) -> Iterator[Any]:
        for item in self.items:
            _tick()
            yield item

    def __len__(self) -> int:
        return len(self.items)  # a TypeError for an iterator (a loop over a loop), whose items a loop then gathers


def _built(value: Any) -> Any:
    """A list, tuple or dict the template's text writes out, counted as built (in a loop, many may be kept)."""
    _spend(_items(len(value)))
    return value


def _written(pieces: int) -> str:
    """Counts the pieces an output statement is about to add to a macro's or block's list of pieces (which compiled
    templates append to directly); writes nothing itself."""
    _spend(_items(pieces))
    return ""


def _sliced(value: Any, start: Any, stop: Any, step: Any) -> Any:
    """value[start:stop:step], a string's or list's slice bounded before it is built (compiled templates slice
    directly, not through the sandbox's getitem)."""
    part = slice(start, stop, step)
    if isinstance(value, (str, list, tuple)):
        length = len(range(*part.indices(len(value))))
        _spend(_text(length) if isinstance(value, str) else _items(length))
    else:
        _tick()
    return value[part]


def _materialized(value: Any) -> Any:
    """An iterator (a generator, a loop) read into a list of at most MAX_ITEMS items, counted as built; any other value
    as it is. Filters' generators are read at once, so what they yield is bounded like any list, and what a filter or
    method is given has a size to bound."""
    if not isinstance(value, Iterator):
        return value
    items = list(itertools.islice(value, MAX_ITEMS + 1))
    _spend(_items(len(items)))
    return items


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """A filter whose result's size is bounded (by _FILTER_COSTS) before it runs, a generator it returns read into a
    list; filters are called directly by compiled templates, not through the sandbox's call."""
    signature, cost = inspect.signature(function), _FILTER_COSTS[name]

    @functools.wraps(function)  # keeps jinja2's pass_context/pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        args = tuple(map(_materialized, args))
        kwargs = {key: _materialized(value) for key, value in kwargs.items()}
        arguments = signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        _spend(cost(arguments.arguments))
        result = function(*args, **kwargs)
        return _materialized(result) if isinstance(result, GeneratorType) else result
    return bounded


class _Guards(Extension):
    """Holds what a compiled template's `for` loops, `~`, slices, literal lists, tuples and dicts, and output
    statements go through (see _Guarded); reached through the environment's extensions, so a template cannot shadow
    them."""

    ticking = _Ticking
    concatenated = staticmethod(_concatenated)
    sliced = staticmethod(_sliced)
    written = staticmethod(_written)
    built = staticmethod(_built)


class _Guarded(NodeTransformer):
    """A parsed template with each `for` loop iterating through _Ticking, so loops that call nothing still check the
    deadline; each `~`, slice and list, tuple or dict it writes out going through _concatenated, _sliced and _built;
    and each output statement whose pieces are gathered in a list (in a macro, a block, a {% set %} or {% filter %}
    block, a recursive loop) counting them through _written. jinja2 compiles all these to plain Python, bounding
    nothing. Autoescape blocks are refused: their Markup strings escape what they touch, growing it."""

    def __init__(self) -> None:
        self.gathering = 0  # how many statements around the node being visited gather their output in a list

    def generic_visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> nodes.Node:
        gathers = isinstance(node, (nodes.Macro, nodes.CallBlock, nodes.FilterBlock, nodes.AssignBlock, nodes.Block))
        gathers |= isinstance(node, nodes.For) and node.recursive
        self.gathering += gathers
        try:
            return super().generic_visit(node, *args, **kwargs)
        finally:
            self.gathering -= gathers

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = self._through("ticking", [node.iter], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return self._through("concatenated", [nodes.Tuple(node.nodes, "load", lineno=node.lineno)], node.lineno)

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        node = self.generic_visit(node)
        if self.gathering:  # the template's own output goes to render(), bounded by the prompt's length
            node.nodes.insert(0, self._through("written", [nodes.Const(len(node.nodes) + 1)], node.lineno))
        return node

    def visit_List(self, node: nodes.List) -> nodes.Node:
        return self._through("built", [self.generic_visit(node)], node.lineno)

    visit_Dict = visit_List

    def visit_Tuple(self, node: nodes.Tuple) -> nodes.Node:
        node = self.generic_visit(node)
        return self._through("built", [node], node.lineno) if node.ctx == "load" else node

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Node:
        node = self.generic_visit(node)
        if not isinstance(node.arg, nodes.Slice):
            return node
        bounds = [nodes.Const(None) if bound is None else bound
                  for bound in (node.arg.start, node.arg.stop, node.arg.step)]
        return self._through("sliced", [node.node, *bounds], node.lineno)

    def visit_ScopedEvalContextModifier(self, node: nodes.ScopedEvalContextModifier) -> nodes.Node:
        raise jinja2.TemplateSyntaxError("autoescape blocks are not supported", node.lineno)

    @staticmethod
    def _through(guard: str, arguments: list[nodes.Expr], lineno: int) -> nodes.Call:
        function = nodes.ExtensionAttribute(_Guards.identifier, guard, lineno=lineno)
        return nodes.Call(function, arguments, [], None, None, lineno=lineno)


def _binop_cost(operator: str, left: Any, right: Any) -> int:
    """The cost of what `left operator right` builds; refuses a number past MAX_INT_BITS before it is computed."""
    sequences = (str, list, tuple)
    if operator == "+" and isinstance(left, sequences) and type(left) is type(right):
        size = len(left) + len(right)
        return _text(size) if isinstance(left, str) else _items(size)
    if operator == "*":
        count, repeated = (left, right) if isinstance(left, int) else (right, left)
        if isinstance(count, int) and isinstance(repeated, sequences):
            size = max(count, 0) * len(repeated)
            return _text(size) if isinstance(repeated, str) else _items(size)
        if isinstance(count, int) and isinstance(repeated, int) and \
                count.bit_length() + repeated.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(f"a number would grow past {MAX_INT_BITS} bits")
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
            right * left.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"{left} ** {right} would grow past {MAX_INT_BITS} bits")
    if operator == "%" and isinstance(left, str):
        return _text(_percent_size(left, right))
    return 0


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, where an unsafe attribute is an error (not an empty value), only the methods in
    _METHODS can be called on strings, dicts, lists and numbers, and every step that can build a large value is
    bounded before it runs."""

    intercepted_binops = frozenset(("*", "**", "+", "%"))
    concat = staticmethod(_concatenated)  # what compiled macros, blocks and {% set %} blocks join their output with

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed")

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if callable(value) and any(isinstance(obj, kinds) and attr not in methods for kinds, methods in _METHODS):
            return False
        return super().is_safe_attribute(obj, attr, value)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja2's names)
        if isinstance(__obj, BuiltinMethodType) and isinstance(__obj.__self__, str):
            args = tuple(map(_materialized, args))
            kwargs = {key: _materialized(value) for key, value in kwargs.items() if key not in _CONTEXT_KEYWORDS}
            _spend(_STR_METHODS[__obj.__name__](__obj.__self__, *args, **kwargs))
        else:  # a macro, a helper (namespace, dict, cycler) or a dict's method: what it makes may keep its arguments
            _spend(_items(len(args) + len(kwargs)))
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """A str's format or format_map, formatting through _Formatter."""
        if super().wrap_str_format(value) is None:
            return None
        template, as_map = value.__self__, value.__name__ == "format_map"

        def formatted(*args: Any, **kwargs: Any) -> str:
            if as_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument, a mapping")
                args, kwargs = (), args[0]
            # the result, and the list of pieces (literal text between braces, fields) Formatter builds it from
            _spend(_text(len(template)) + _items(template.count("{") + template.count("}")))
            return _Formatter(self, template).vformat(template, args, kwargs)
        return formatted

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _spend(_binop_cost(operator, left, right))
        return _number(super().call_binop(context, operator, left, right))


class _Undefined(jinja2.Undefined):
    """jinja2's Undefined, keeping only the start of a long name: its errors quote the name."""

    __slots__ = ()

    def __init__(self, hint: str | None = None, obj: Any = missing, name: str | None = None,
                 exc: type[jinja2.TemplateRuntimeError] = jinja2.UndefinedError):
        super().__init__(hint, obj, name[:MAX_NAME] if isinstance(name, str) else name, exc)


def _raise_exception(message: Any) -> None:
    raise RaisedByTemplate(_as_text(message)[:500])


def _dict(*args: Any, **kwargs: Any) -> dict:
    """jinja2's `dict` global as a function, so a template cannot reach the type's methods (dict.fromkeys)."""
    return dict(*args, **kwargs)


def _escaped(value: Any) -> str:
    """HTML-escaped text, as plain text (no Markup here: autoescape is off)."""
    return str(markupsafe.escape(value))


def _tojson(value: Any, indent: int | str | None = None, ensure_ascii: bool = False, separators: Any = None,
            sort_keys: bool = False) -> str:
    """JSON as chat templates expect it (tool schemas, call arguments): not HTML-escaped, Unicode kept. Its size is
    bounded before it is written, and it is written piece by piece, checking the deadline, into one buffer."""
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys,
                               separators=tuple(separators) if separators is not None else None)
    level = indent if isinstance(indent, int) else len(indent or "")
    between = len(encoder.item_separator) + len(encoder.key_separator)
    _spend(_text(level) + _text(_text_size(value, quoted=True, separators=between, indent=level)))
    text = io.StringIO()
    for piece in _Ticking(encoder.iterencode(value)):
        text.write(piece)
    return text.getvalue()


def _environment() -> _Sandbox:
    # trim_blocks and lstrip_blocks: the whitespace handling Qwen's templates are written for.
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, autoescape=False, finalize=_as_text, undefined=_Undefined,
                   extensions=["jinja2.ext.loopcontrols", _Guards])
    env.globals["raise_exception"] = _raise_exception
    env.globals["dict"] = _dict
    del env.globals["lipsum"]  # 20 s of CPU for a few words of Latin
    env.filters |= {"tojson": _tojson, "safe": _as_text, "e": _escaped, "escape": _escaped, "forceescape": _escaped}
    # a filter with an async variant is a wrapper that passes an unused argument: the sync function is the filter
    env.filters = {name: _bounded_filter(name, function.__wrapped__ if hasattr(function, "jinja_async_variant")
                                         else function)
                   for name, function in env.filters.items() if name in _FILTER_COSTS}
    return env


_ENVIRONMENT = _environment()


def compile_template(source: str) -> jinja2.Template:
    """`source` compiled in the sandbox, its loops, `~`, slices, literals and gathered output guarded (see _Guarded).
    Compiling folds constant expressions, calling filters, so it can fail as rendering does (TEMPLATE_FAILURES)."""
    with allowance(0):
        return _ENVIRONMENT.from_string(_Guarded().visit(_ENVIRONMENT.parse(source)))
