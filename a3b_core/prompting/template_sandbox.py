"""The sandbox chat templates are compiled and rendered in: jinja2's immutable sandbox (no attribute starting with an
underscore, no method that changes a list or dict), with the helpers Qwen's templates use (raise_exception, tojson,
loop controls).

Rendering is bounded before the work is done: every step that can build a large value goes through its cost
(template_costs.py) first; loop steps, calls, attribute reads and operations check the CPU time spent, and no single
step the caps allow runs long past it; recursion ends in an error. compile_template compiles a template with these
guards; each render runs within a template_costs.allowance.
"""
from __future__ import annotations

import functools
import inspect
import io
import itertools
import json
import reprlib
from collections.abc import Callable, Iterable, Iterator
from types import BuiltinMethodType, GeneratorType
from typing import Any

import jinja2
import markupsafe
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter, SecurityError
from jinja2.utils import missing
from jinja2.visitor import NodeTransformer

from .template_costs import (FILTER_COSTS, FORMAT_SPEC, MAX_ITEMS, MAX_NAME, MAX_TEXT, STR_METHOD_COSTS, TOO_LONG,
                             TemplateLimitError, allowance, as_text, binop_cost, checked_number, field_size,
                             items_cost, spend, text_cost, text_size, tick)

# What a template's own expressions can raise, besides jinja2's errors and the limits here (truncate asserts).
TEMPLATE_FAILURES = (jinja2.TemplateError, RecursionError, MemoryError, ArithmeticError, TypeError, ValueError,
                     LookupError, AttributeError, AssertionError)


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


_CONTEXT_KEYWORDS = ("_loop_vars", "_block_vars")  # what compiled templates pass to every call, for jinja2's own use
# The methods a template may call on the conversation's values; no method of a number (int.to_bytes builds bytes of
# any length), nor list.index (its error quotes its argument).
_METHODS = ((str, frozenset(STR_METHOD_COSTS)), (dict, frozenset(("get", "items", "keys", "values"))),
            ((list, tuple), frozenset(("count",))), ((int, float), frozenset()))


class _Formatter(SandboxedFormatter):
    """str.format in the sandbox: each field's size is bounded, with its nested width and precision resolved, before
    it is converted or formatted."""

    def __init__(self, environment: jinja2.Environment, template: str):
        super().__init__(environment)
        self.size = len(template)  # characters of the result so far: its literal text, then each field

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion is not None:  # !s, !r, !a
            spend(text_cost(text_size(value, quoted=conversion != "s")))
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> Any:
        spec = FORMAT_SPEC.fullmatch(format_spec)
        if spec is None:
            raise TemplateLimitError(f"the format spec {format_spec[:40]!r} is not one of Python's")
        size = field_size(value, *(int(number or 0) for number in spec.groups()))
        self.size += size
        if self.size > MAX_TEXT:
            raise TemplateLimitError(TOO_LONG)
        spend(text_cost(size) + size)  # the field's text, and its copy in the result
        return super().format_field(value, format_spec)


# ------------------------------------------------------------------------------------------------ bounded steps
def _concatenated(values: Iterable[Any]) -> str:
    """The values' text joined, its size bounded before it is built: `~`, and the output of a macro or block."""
    texts = [as_text(value) for value in values]
    spend(text_cost(sum(map(len, texts))))
    return "".join(texts)


class _Ticking:
    """An iterable's items, checking the deadline at each: what every `for` loop iterates through. It has the
    iterable's length, so loop.length and loop.revindex need not gather the items into a list."""

    def __init__(self, items: Iterable[Any]):
        self.items = items

    def __iter__(self) -> Iterator[Any]:
        for item in self.items:
            tick()
            yield item

    def __len__(self) -> int:
        return len(self.items)  # a TypeError for an iterator (a loop over a loop), whose items a loop then gathers


def _built(value: Any) -> Any:
    """A list, tuple or dict the template's text writes out, counted as built (in a loop, many may be kept)."""
    spend(items_cost(len(value)))
    return value


def _written(pieces: int) -> str:
    """Counts the pieces an output statement is about to add to a macro's or block's list of pieces (which compiled
    templates append to directly); writes nothing itself."""
    spend(items_cost(pieces))
    return ""


def _sliced(value: Any, start: Any, stop: Any, step: Any) -> Any:
    """value[start:stop:step], a string's or list's slice bounded before it is built (compiled templates slice
    directly, not through the sandbox's getitem)."""
    part = slice(start, stop, step)
    if isinstance(value, (str, list, tuple)):
        length = len(range(*part.indices(len(value))))
        spend(text_cost(length) if isinstance(value, str) else items_cost(length))
    else:
        tick()
    return value[part]


def _materialized(value: Any) -> Any:
    """An iterator (a generator, a loop) read into a list of at most MAX_ITEMS items, counted as built; any other value
    as it is. Filters' generators are read at once, so what they yield is bounded like any list, and what a filter or
    method is given has a size to bound."""
    if not isinstance(value, Iterator):
        return value
    items = list(itertools.islice(value, MAX_ITEMS + 1))
    spend(items_cost(len(items)))
    return items


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """A filter whose result's size is bounded (by FILTER_COSTS) before it runs, a generator it returns read into a
    list; filters are called directly by compiled templates, not through the sandbox's call."""
    signature, cost = inspect.signature(function), FILTER_COSTS[name]

    @functools.wraps(function)  # keeps jinja2's pass_context/pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        args = tuple(map(_materialized, args))
        kwargs = {key: _materialized(value) for key, value in kwargs.items()}
        arguments = signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        spend(cost(arguments.arguments))
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
            spend(STR_METHOD_COSTS[__obj.__name__](__obj.__self__, *args, **kwargs))
        else:  # a macro, a helper (namespace, dict, cycler) or a dict's method: what it makes may keep its arguments
            spend(items_cost(len(args) + len(kwargs)))
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        tick()
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
            spend(text_cost(len(template)) + items_cost(template.count("{") + template.count("}")))
            return _Formatter(self, template).vformat(template, args, kwargs)
        return formatted

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        spend(binop_cost(operator, left, right))
        return checked_number(super().call_binop(context, operator, left, right))


class _Undefined(jinja2.Undefined):
    """jinja2's Undefined, keeping only the start of a long name: its errors quote the name."""

    __slots__ = ()

    def __init__(self, hint: str | None = None, obj: Any = missing, name: str | None = None,
                 exc: type[jinja2.TemplateRuntimeError] = jinja2.UndefinedError):
        super().__init__(hint, obj, name[:MAX_NAME] if isinstance(name, str) else name, exc)


def _raise_exception(message: Any) -> None:
    raise RaisedByTemplate(as_text(message)[:500])


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
    spend(text_cost(level) + text_cost(text_size(value, quoted=True, separators=between, indent=level)))
    text = io.StringIO()
    for piece in _Ticking(encoder.iterencode(value)):
        text.write(piece)
    return text.getvalue()


def _environment() -> _Sandbox:
    # trim_blocks and lstrip_blocks: the whitespace handling Qwen's templates are written for.
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, autoescape=False, finalize=as_text, undefined=_Undefined,
                   extensions=["jinja2.ext.loopcontrols", _Guards])
    env.globals["raise_exception"] = _raise_exception
    env.globals["dict"] = _dict
    del env.globals["lipsum"]  # 20 s of CPU for a few words of Latin
    env.filters |= {"tojson": _tojson, "safe": as_text, "e": _escaped, "escape": _escaped, "forceescape": _escaped}
    # a filter with an async variant is a wrapper that passes an unused argument: the sync function is the filter
    env.filters = {name: _bounded_filter(name, function.__wrapped__ if hasattr(function, "jinja_async_variant")
                                         else function)
                   for name, function in env.filters.items() if name in FILTER_COSTS}
    return env


_ENVIRONMENT = _environment()


def compile_template(source: str) -> jinja2.Template:
    """`source` compiled in the sandbox, its loops, `~`, slices, literals and gathered output guarded (see _Guarded).
    Compiling folds constant expressions, calling filters, so it can fail as rendering does (TEMPLATE_FAILURES)."""
    with allowance(0):
        return _ENVIRONMENT.from_string(_Guarded().visit(_ENVIRONMENT.parse(source)))
