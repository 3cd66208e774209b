"""The core's records as JSON and back, from their type hints: what a re-exec hands to the
next daemon (``unit.reexec``), the whole ``Core`` of each server.

One generic pair instead of a ``to_dict``/``from_dict`` per record: frozen dataclasses,
enums, ``X | None``, tuples (``tuple[X, ...]`` and fixed), lists, frozensets and
``dict[str, X]``, all from the annotations, so a field added to a record travels without a
line written for it. ``decode`` checks every value against its type and raises
``CodecError`` (one line: the path and what is wrong) on anything it does not expect: a
record from another version that does not fit is refused whole, never half-read.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any

Json = None | bool | int | float | str | list["Json"] | dict[str, "Json"]


class CodecError(ValueError):
    pass


def encode(value: Any) -> Json:
    """``value`` as plain JSON data (dataclasses as objects of their fields)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value.value if isinstance(value, enum.Enum) else value
    if isinstance(value, enum.Enum):
        return encode(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list | frozenset | set):
        items = sorted(value) if isinstance(value, frozenset | set) else value
        return [encode(v) for v in items]
    if isinstance(value, Mapping):
        return {str(k): encode(v) for k, v in value.items()}
    raise CodecError(f"cannot encode a {type(value).__name__}")


def decode(tp: Any, data: Json, path: str = "$") -> Any:
    """``data`` (from ``encode``) as a value of type ``tp``; ``CodecError`` when it is not one."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return data
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if data is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return decode(option, data, path)
            except CodecError as exc:
                errors.append(str(exc))
        raise CodecError(errors[0] if len(errors) == 1 else f"{path}: fits none of {tp}")
    if origin in (tuple, list, frozenset, set):
        if not isinstance(data, list):
            raise CodecError(f"{path}: expected a list, got {_what(data)}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(data):
                raise CodecError(f"{path}: expected {len(args)} items, got {len(data)}")
            return tuple(decode(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data, strict=True)))
        item = args[0] if args else Any
        return origin(decode(item, v, f"{path}[{i}]") for i, v in enumerate(data))
    if origin in (dict, Mapping):
        if not isinstance(data, dict):
            raise CodecError(f"{path}: expected an object, got {_what(data)}")
        _key, value_tp = typing.get_args(tp) or (str, Any)
        return {k: decode(value_tp, v, f"{path}.{k}") for k, v in data.items()}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            raise CodecError(f"{path}: {data!r} is not a {tp.__name__}") from None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _record(tp, data, path)
    if tp is float:
        if isinstance(data, int | float) and not isinstance(data, bool):
            return float(data)
        raise CodecError(f"{path}: expected a number, got {_what(data)}")
    if tp in (bool, int, str):
        if type(data) is tp:
            return data
        raise CodecError(f"{path}: expected {tp.__name__}, got {_what(data)}")
    raise CodecError(f"{path}: cannot decode a {tp!r}")


def _record(tp: type, data: Json, path: str) -> Any:
    if not isinstance(data, dict):
        raise CodecError(f"{path}: expected an object for {tp.__name__}, got {_what(data)}")
    hints = _hints(tp)
    fields = {f.name: f for f in dataclasses.fields(tp)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise CodecError(f"{path}: {tp.__name__} has no field {unknown[0]!r}")
    values = {}
    for name, f in fields.items():
        if name in data:
            values[name] = decode(hints[name], data[name], f"{path}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise CodecError(f"{path}: {tp.__name__} needs {name!r}")
    return tp(**values)


@functools.cache
def _hints(tp: type) -> dict[str, Any]:
    return typing.get_type_hints(tp)


def _what(data: Json) -> str:
    return "null" if data is None else type(data).__name__
