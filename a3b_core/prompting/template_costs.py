"""What a chat template's steps cost, counted before they run, and the allowance a render spends them from.

Every step that builds a string or a list (operators, filters, str methods, formatting, slicing, literals, calls,
output) computes the size of its result from its operands first, and is refused past the caps on one value (MAX_TEXT,
MAX_ITEMS, MAX_INT_BITS) or on all that a render builds (MAX_BUILT, plus BUILT_PER_CHARACTER per character of the
conversation). A cost is in bytes, as text_cost and items_cost count them; `spend` takes it off the allowance of the
render under way, and `tick` checks the CPU time it has spent against RENDER_SECONDS.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, ValuesView
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.utils import Namespace

MAX_TEXT = 16 * 2**20  # characters of one string a template builds, and of the prompt it renders
MAX_ITEMS = 2**17  # items of one list, tuple or dict a template builds (the sort filter takes about 0.5 s on this many)
MAX_WORD_TEXT = 2**17  # characters a filter that runs Python code per word takes (wordwrap: about 0.06 s)
MAX_INT_BITS = 4096  # a template counts images and turns; it never needs numbers near this size
MAX_ROUND_DIGITS = 400  # round's precision (a float has at most 309 digits before its point)
MAX_NAME = 256  # characters of a filter, test or attribute name given to a filter (jinja2 splits and quotes them)
# What one render may build in all, in bytes as text_cost and items_cost count them: a base, and more per character
# of the conversation, which Qwen's templates copy about 7 times (so a prompt of MAX_TEXT characters still renders).
MAX_BUILT = 32 * 2**20
BUILT_PER_CHARACTER = 16
VALUE_BYTES = 64  # counted for each value built: a string's or list's header, or an item's pointer and small object
# CPU seconds of the rendering thread (so a busy machine cannot make a good template fail); a typical prompt renders
# in about a millisecond
RENDER_SECONDS = 2.0


class TemplateLimitError(jinja2.TemplateError):
    """A template went past a limit on time or size."""


# ------------------------------------------------------------------------------------------------ the allowance
TOO_LONG = f"a string would grow past {MAX_TEXT} characters"


@dataclass
class _Allowance:
    """What the render (or compile) under way may still spend."""
    deadline: float  # in thread_time()
    total: int  # bytes of values it may build, as text_cost and items_cost count them
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


def tick() -> None:
    if time.thread_time() > _ALLOWANCE.get().deadline:
        raise TemplateLimitError(f"rendering took over {RENDER_SECONDS:g} s of CPU time")


def spend(cost: int) -> None:
    """Called before building values that cost `cost` bytes: refuses them past the allowance, else takes them off."""
    tick()
    current = _ALLOWANCE.get()
    if cost > current.left:
        raise TemplateLimitError(f"it built over {current.total // 2**20} MiB of strings and lists, more than one "
                                 "render of this conversation may")
    current.left -= cost


def text_cost(characters: int) -> int:
    """The cost of a string of `characters`; refuses one longer than MAX_TEXT."""
    if characters > MAX_TEXT:
        raise TemplateLimitError(TOO_LONG)
    return VALUE_BYTES + max(characters, 0)


def items_cost(count: int) -> int:
    """The cost of a list of `count` items (each may be a new small object); refuses one longer than MAX_ITEMS."""
    if count > MAX_ITEMS:
        raise TemplateLimitError(f"a list would grow past {MAX_ITEMS} items")
    return VALUE_BYTES * (max(count, 0) + 1)


def checked_number(value: Any) -> Any:
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


def text_size(value: Any, quoted: bool = False, separators: int = 2, indent: int = 0) -> int:
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
            tick()
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
    """The sum of the items' text sizes (see text_size), counted until it passes MAX_TEXT."""
    if isinstance(items, str):
        return len(items)
    total = 0
    for item in items:
        total += text_size(item)
        if total > MAX_TEXT:
            break
    return total


_NUMBER_CHARS = 440  # a float written out in full ('%f' of 1e308: 309 digits), with grouping, sign and point
# Python's format spec: [[fill]align][sign][z][#][0][width][grouping][.precision][type]
FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?[bcdeEfFgGnosxX%]?", re.DOTALL)
# printf-style: %[(key)][flags][width][.precision][length]type
_PERCENT_FIELD = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?(.)", re.DOTALL)


def field_size(value: Any, width: int, precision: int, quoted: bool = False) -> int:
    """An upper bound on the characters of one formatted field: `value` as text (its repr when `quoted`) or in any
    number format (an int in binary is the longest), padded to `width`."""
    if isinstance(value, (int, float)) and not quoted:
        size = _NUMBER_CHARS + (2 * value.bit_length() if isinstance(value, int) else 0)
    else:
        size = text_size(value, quoted)
    return abs(width) + abs(precision) + size


def _percent_size(template: str, values: Any) -> int:
    """An upper bound on the characters of `template % values`, each '*' width or precision read from the values."""
    positional = iter(values if isinstance(values, tuple) else (values,))
    size = len(template)
    for number, field in enumerate(_PERCENT_FIELD.finditer(template)):
        key, width, precision, conversion = field.groups(default="")
        if number % 4096 == 0:
            tick()
        if conversion == "%":
            continue
        if size > MAX_TEXT:
            break
        if "(" in key:  # Python reads nested parentheses in a key, which this pattern does not
            raise TemplateLimitError(f"the format key {key[:40]!r} has a parenthesis")
        width = next(positional, 0) if width == "*" else int(width or 0)
        precision = next(positional, 0) if precision == "*" else int(precision or 0)
        value = values[key] if key else next(positional, None)
        size += field_size(value, width, precision, quoted=conversion in "ra")
    return size


def _replaced_size(text: str, old: str, new: str, count: int | None) -> int:
    occurrences = len(text) + 1 if old == "" else text.count(old)
    if count is not None and count >= 0:
        occurrences = min(occurrences, count)
    return len(text) + occurrences * max(len(new) - len(old), 0)


def _line_count(text: str) -> int:
    """An upper bound on the line breaks splitlines() finds."""
    return sum(text.count(mark) for mark in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")


def _joined_cost(items: Any, separator: str) -> int:
    return text_cost(_total_size(items) + len(separator) * max(len(items) - 1, 0))


def _ordering_cost(items: Any) -> int:
    """Sorting, grouping, deduplicating or taking the least of `items`: a list of them, and the lower-cased copies of
    their text it compares (a case mapping is up to 3 characters). Bounding their text also bounds the comparing."""
    return items_cost(len(items)) + text_cost(3 * _total_size(items))


def _word_by_word(name: str, value: Any) -> int:
    """A filter that runs Python code per word or character: its text is capped (so it takes well under a second)
    and it may build a list of its words."""
    size = text_size(value)
    if size > MAX_WORD_TEXT:
        raise TemplateLimitError(f"the {name} filter works word by word and takes at most {MAX_WORD_TEXT} characters")
    return items_cost(size)


def _failed_number_cost(value: Any) -> int:
    """float() of a text that is not a number writes the text's repr into its error."""
    return text_cost(text_size(value, quoted=True)) if isinstance(value, str) else 0


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
    size = text_size(text) + lines * (1 + (len(width) if isinstance(width, str) else width))
    return items_cost(lines) + 3 * text_cost(size)


def _names_cost(*names: Any) -> int:
    """Refuses a filter, test or attribute name longer than MAX_NAME: jinja2 splits one at each dot and quotes one it
    cannot find in its error."""
    if any(isinstance(name, str) and len(name) > MAX_NAME for name in names):
        raise TemplateLimitError(f"a filter, test or attribute name is over {MAX_NAME} characters")
    return 0


def _free(*_: Any, **__: Any) -> int:
    return 0


def _text_long(text: str, *_: Any) -> int:
    return text_cost(len(text))


def _case_changed(text: str) -> int:
    return text_cost(3 * len(text))


def _padded(text: str, width: int, fillchar: str = " ") -> int:
    return text_cost(max(len(text), width))


def _split_cost(text: str, sep: str | None = None, maxsplit: int = -1) -> int:
    pieces = len(text) // 2 + 1 if sep is None else text.count(sep) + 1
    if maxsplit >= 0:
        pieces = min(pieces, maxsplit + 1)
    return items_cost(pieces) + text_cost(len(text))


# The str methods a template may call, each with the cost of its result from its arguments (format and format_map go
# through the sandbox's _Formatter). Any other str method (encode, translate, ...) is refused.
STR_METHOD_COSTS: dict[str, Callable[..., int]] = {
    **dict.fromkeys(("capitalize", "casefold", "lower", "swapcase", "title", "upper"), _case_changed),
    **dict.fromkeys(("center", "ljust", "rjust", "zfill"), _padded),
    "expandtabs": lambda text, tabsize=8: text_cost(len(text) + text.count("\t") * max(tabsize, 0)),
    "join": lambda text, items: _joined_cost(items, text),
    "replace": lambda text, old, new, count=-1: text_cost(_replaced_size(text, old, new, count)),
    "split": _split_cost,
    "rsplit": _split_cost,
    "splitlines": lambda text, keepends=False: items_cost(_line_count(text) + 1) + text_cost(len(text)),
    **dict.fromkeys(("lstrip", "partition", "removeprefix", "removesuffix", "rpartition", "rstrip", "strip"),
                    _text_long),
    **dict.fromkeys(("count", "endswith", "find", "index", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit",
                     "isidentifier", "islower", "isnumeric", "isprintable", "isspace", "istitle", "isupper", "rfind",
                     "rindex", "startswith"), _free),
}

# Each filter kept, with the cost of its result from its arguments (as jinja2's signature for it names them);
# filters not listed (urlize, pprint) are removed.
FILTER_COSTS: dict[str, Callable[[dict[str, Any]], int]] = {
    # a number, an item, or a generator (read into a list, counted: see the sandbox's _materialized)
    **dict.fromkeys(("abs", "attr", "count", "d", "default", "first", "items", "last", "length", "random", "safe",
                     "tojson"), _free),  # safe, tojson: ours
    **dict.fromkeys(("map", "reject", "rejectattr", "select", "selectattr"),
                    lambda a: _names_cost(*a["args"][:1], a["kwargs"].get("attribute"))),
    "float": lambda a: _failed_number_cost(a["value"]),
    "int": lambda a: _failed_number_cost(a["value"]),
    "filesizeformat": lambda a: _failed_number_cost(a["value"]),
    "round": lambda a: _rounding_cost(a["precision"]),
    **dict.fromkeys(("capitalize", "lower", "upper"), lambda a: text_cost(3 * text_size(a["s"]))),
    "title": lambda a: _word_by_word("title", a["s"]) + text_cost(3 * text_size(a["s"])),
    "trim": lambda a: text_cost(text_size(a["value"])),
    "string": lambda a: text_cost(text_size(a["s"])),
    **dict.fromkeys(("e", "escape", "forceescape"), lambda a: text_cost(6 * text_size(a["value"]))),
    "center": lambda a: text_cost(max(text_size(a["value"]), a["width"])),
    "indent": lambda a: _indented_cost(a["s"], a["width"]),
    "truncate": lambda a: 3 * text_cost(min(text_size(a["s"]), a["length"] + len(a["end"]))),
    "wordcount": lambda a: _word_by_word("wordcount", a["s"]),
    "wordwrap": lambda a: (_word_by_word("wordwrap", a["s"])
                           + text_cost(text_size(a["s"]) * (1 + len(a["wrapstring"] or "\n")))),
    "striptags": lambda a: _word_by_word("striptags", a["value"]) + text_cost(text_size(a["value"])),
    "urlencode": lambda a: _word_by_word("urlencode", a["value"]) + text_cost(12 * text_size(a["value"])),
    "xmlattr": lambda a: _word_by_word("xmlattr", a["d"]) + text_cost(6 * text_size(a["d"])),
    "replace": lambda a: text_cost(_replaced_size(*map(as_text, (a["s"], a["old"], a["new"])), a["count"])),
    "format": lambda a: text_cost(_percent_size(as_text(a["value"]), a["kwargs"] or a["args"])),
    "join": lambda a: _names_cost(a["attribute"]) + 2 * _joined_cost(a["value"], as_text(a["d"])),  # items, result
    "list": lambda a: items_cost(len(a["value"])),
    "reverse": lambda a: text_cost(len(a["value"])) if isinstance(a["value"], str) else items_cost(len(a["value"])),
    "batch": lambda a: items_cost(len(a["value"])) + items_cost(a["linecount"]),
    "slice": lambda a: items_cost(len(a["value"])) + items_cost(a["slices"]),
    **dict.fromkeys(("max", "min", "sort", "unique"),
                    lambda a: _names_cost(a["attribute"]) + _ordering_cost(a["value"])),
    "dictsort": lambda a: _ordering_cost(a["value"].items()),
    "groupby": lambda a: _names_cost(a["attribute"]) + 2 * _ordering_cost(a["value"]),
    "sum": lambda a: _names_cost(a["attribute"]) + _summing_cost(a["start"]),
}


# ------------------------------------------------------------------------------------------------ text and operators
def as_text(value: Any) -> str:
    """str(value), its size bounded before it is built: what `{{ }}` writes, and jinja2's `safe` filter (no Markup
    here: autoescape is off)."""
    if isinstance(value, str):
        return value
    spend(text_cost(text_size(value)))
    return str(value)


def binop_cost(operator: str, left: Any, right: Any) -> int:
    """The cost of what `left operator right` builds; refuses a number past MAX_INT_BITS before it is computed."""
    sequences = (str, list, tuple)
    if operator == "+" and isinstance(left, sequences) and type(left) is type(right):
        size = len(left) + len(right)
        return text_cost(size) if isinstance(left, str) else items_cost(size)
    if operator == "*":
        count, repeated = (left, right) if isinstance(left, int) else (right, left)
        if isinstance(count, int) and isinstance(repeated, sequences):
            size = max(count, 0) * len(repeated)
            return text_cost(size) if isinstance(repeated, str) else items_cost(size)
        if isinstance(count, int) and isinstance(repeated, int) and \
                count.bit_length() + repeated.bit_length() > MAX_INT_BITS:
            raise TemplateLimitError(f"a number would grow past {MAX_INT_BITS} bits")
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
            right * left.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"{left} ** {right} would grow past {MAX_INT_BITS} bits")
    if operator == "%" and isinstance(left, str):
        return text_cost(_percent_size(left, right))
    return 0
