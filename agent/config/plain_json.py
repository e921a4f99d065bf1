"""Plain frozen structs to JSON and back, checked against their type hints.

The config checker (:mod:`agent.config.check`) validates a config in a process of its own and hands the agent the
structs of :mod:`agent.config.model` as JSON; :func:`from_plain` rebuilds them, checking every value against
its field's type (``str``, ``int``, ``bool``, ``float``, ``Literal``, a ``StrEnum``, ``list``, ``dict``, unions,
``None`` and nested structs), so what comes back is what the types promise, or a :class:`PlainJsonError`
naming the path of the first value that is not.
"""

from __future__ import annotations

import enum
import functools
import types
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from msgspec import Struct

T = TypeVar("T")
_NONE = type(None)


class PlainJsonError(ValueError):
    """A value that does not fit its field's type; the message names its path (``sharing.mps.resources[0]``)."""


def to_plain(value: object) -> object:
    """A struct (and what it holds) as JSON-ready values: dicts keyed by field name, lists, scalars."""
    if isinstance(value, Struct):
        return {name: to_plain(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    return value


def from_plain(cls: type[T], value: object, path: str = "") -> T:
    """``cls`` rebuilt from :func:`to_plain`'s output; :class:`PlainJsonError` naming the path of a misfit."""
    return _decode(cls, value, path or cls.__name__)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _decode(tp: Any, value: object, path: str) -> Any:
    if tp is Any:
        return value
    origin = get_origin(tp)
    if isinstance(tp, type) and issubclass(tp, Struct):
        if not isinstance(value, dict):
            raise PlainJsonError(f"{path}: expected an object for {tp.__name__}, got {type(value).__name__}")
        hints = _hints(tp)
        names = set(tp.__struct_fields__)
        unknown = sorted(set(value) - names)
        if unknown:
            raise PlainJsonError(f"{path}: {tp.__name__} has no field {unknown[0]!r}")
        return tp(**{name: _decode(hints[name], item, f"{path}.{name}") for name, item in value.items()})
    if origin in (Union, types.UnionType):
        arguments = get_args(tp)
        if value is None and _NONE in arguments:
            return None
        errors = []
        for argument in arguments:
            if argument is _NONE:
                continue
            try:
                return _decode(argument, value, path)
            except PlainJsonError as error:
                errors.append(error)
        if len(errors) == 1:  # X | None: what is wrong inside X, where it is
            raise errors[0]
        raise PlainJsonError(f"{path}: {str(value)[:80]} fits none of {tp}")
    if origin is Literal:
        if value in get_args(tp) and type(value) in {type(a) for a in get_args(tp)}:
            return value
        raise PlainJsonError(f"{path}: {value!r} is not one of {list(get_args(tp))}")
    if origin is list:
        if not isinstance(value, list):
            raise PlainJsonError(f"{path}: expected a list, got {type(value).__name__}")
        (item_type,) = get_args(tp) or (Any,)
        return [_decode(item_type, item, f"{path}[{n}]") for n, item in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list):
            raise PlainJsonError(f"{path}: expected a list, got {type(value).__name__}")
        arguments = get_args(tp)
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return tuple(_decode(arguments[0], item, f"{path}[{n}]") for n, item in enumerate(value))
        if len(arguments) != len(value):
            raise PlainJsonError(f"{path}: expected {len(arguments)} items, got {len(value)}")
        return tuple(_decode(a, item, f"{path}[{n}]") for n, (a, item) in enumerate(zip(arguments, value, strict=True)))
    if origin is dict:
        if not isinstance(value, dict):
            raise PlainJsonError(f"{path}: expected an object, got {type(value).__name__}")
        key_type, item_type = get_args(tp) or (Any, Any)
        return {
            _decode(key_type, key, f"{path} key"): _decode(item_type, item, f"{path}[{key!r}]")
            for key, item in value.items()
        }
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise PlainJsonError(f"{path}: {value!r} is not a {tp.__name__}") from None
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise PlainJsonError(f"{path}: expected a number, got {type(value).__name__}")
    if tp in (str, int, bool):
        if type(value) is tp:  # a bool is no int here, and an int no bool
            return value
        raise PlainJsonError(f"{path}: expected {tp.__name__}, got {type(value).__name__}")
    if tp in (dict, list):  # unparameterised: any JSON object or list, as it is
        if isinstance(value, tp):
            return value
        raise PlainJsonError(f"{path}: expected {'an object' if tp is dict else 'a list'}, got {type(value).__name__}")
    if tp is _NONE:
        if value is None:
            return None
        raise PlainJsonError(f"{path}: expected null, got {type(value).__name__}")
    raise PlainJsonError(f"{path}: cannot rebuild a {tp!r}")


__all__ = ["PlainJsonError", "from_plain", "to_plain"]
