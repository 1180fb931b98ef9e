"""Option values of plain types skip typer's pydantic adapters (a library patch: applied by
cli/library_patches' `apply`).

Typer (from 0.2x) turns every option's text into its annotated type with a pydantic TypeAdapter built for
the annotation. Importing pydantic and building the adapters of `run`'s fifty options takes about 0.1 s of
every start, a seventh of ggrun's time to its first token. For the plain types ggrun's options use, what
the adapter makes of an ordinary value is plain: a decimal integer's int, a decimal number's float, a
text as it is, what the option's parser returns, a bool flag's bool, and lists of these. Such values are
turned here; any other (and any the parser rejects) goes to typer's adapter, built when first needed,
which gives typer's value or typer's error message as before.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from enum import Enum
from typing import Any, get_args, get_origin

_BUILTINS = (bool, int, float, str)


def install() -> None:
    """Route typer's options through `runtime_param` below (once per process; a typer without the
    adapter layer is left as it is)."""
    try:
        from typer import _coercion, core
    except ImportError:
        return
    full = getattr(core, "build_runtime_param", None)
    if full is None or getattr(full, "plain_options", False):
        return

    @dataclass(frozen=True)
    class PlainRuntimeParam(_coercion.RuntimeParam):
        """Hands through a value of the plain annotated type; typer's own param takes any other."""

        descriptor: Any = None

        @cached_property
        def full_param(self) -> Any:
            return full(self.descriptor)

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            plain = _plain_value(self.annotation, self.parameter_info, value)
            return plain if plain is not _OTHER else self.full_param._coerce_value(value, param=param, ctx=ctx)

    def runtime_param(descriptor):
        info = descriptor.parameter_info
        ranged = getattr(info, "min", None) is not None or getattr(info, "max", None) is not None
        if descriptor.file_annotation is not None or ranged or _element_type(descriptor.annotation) is None:
            return full(descriptor)
        return PlainRuntimeParam(parameter_info=descriptor.parameter_info, annotation=descriptor.annotation,
                                 descriptor=descriptor)

    runtime_param.plain_options = True
    runtime_param.typer_own = full
    core.build_runtime_param = runtime_param


def _is_plain(t: Any) -> bool:
    return isinstance(t, type) and (t in _BUILTINS or issubclass(t, Enum))


def _element_type(annotation: Any) -> type | None:
    """T for an annotation T or list[T] of a plain T, else None."""
    if get_origin(annotation) is list:
        args = get_args(annotation)
        return args[0] if len(args) == 1 and _is_plain(args[0]) else None
    return annotation if _is_plain(annotation) else None


_OTHER = object()  # a value left to typer's adapter
_INT = re.compile(r"-?[0-9]+")
_FLOAT = re.compile(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")


def _plain_one(t: type, info: Any, value: Any) -> Any:
    """What typer's adapter makes of `value` for the plain type t, where that is unambiguous; else _OTHER."""
    parser = getattr(info, "parser", None)
    if parser is not None:  # the adapter calls the parser on any value; a failure is left to it to report
        try:
            return parser(value)
        except Exception:
            return _OTHER
    if isinstance(value, t) if issubclass(t, Enum) else type(value) is t:  # a bool is not an int here
        return value
    if type(value) is str and t is int and _INT.fullmatch(value):
        return int(value)
    if type(value) is str and t is float and _FLOAT.fullmatch(value):
        return float(value)
    return _OTHER


def _plain_value(annotation: Any, info: Any, value: Any) -> Any:
    t = _element_type(annotation)
    if get_origin(annotation) is not list:
        return _plain_one(t, info, value)
    if not isinstance(value, (list, tuple)):
        return _OTHER
    items = [_plain_one(t, info, v) for v in value]
    return _OTHER if any(v is _OTHER for v in items) else items
