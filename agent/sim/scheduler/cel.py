"""Kubernetes' CEL environment for DRA device selectors, on cel-python (``celpy``).

What an expression sees (``k8s.io/dynamic-resource-allocation/cel``, ``compile.go``): one variable, ``device``,
with ``driver`` (string), ``allowMultipleAllocations`` (bool), ``attributes`` and ``capacity``, both maps from
a domain to a map from a name to a value. An attribute named without a domain is in the driver's domain
(``gpu.nvidia.com/type`` and ``type`` are both ``device.attributes['gpu.nvidia.com'].type``). Attribute values
are int, bool, string or ``Semver`` (list forms become lists); capacities are ``Quantity``. Looking up an
unknown domain gives an empty map; an unknown name in a known map is an evaluation error ("no such key").

Functions, as Kubernetes' base environment defines them (``k8s.io/apiserver/pkg/cel/library`` and cel-go's
``ext``) for the ones a claim realistically uses:

* CEL's standard library as celpy has it: ``size``, ``contains``, ``startsWith``, ``endsWith``, ``matches``
  (RE2), ``has``, ``in``, ``all``/``exists``/``exists_one``/``map``/``filter``, conversions.
* quantity: ``quantity(s)``, ``isQuantity(s)``, ``q.compareTo(q)``, ``q.isGreaterThan(q)``, ``q.isLessThan(q)``,
  ``q.sign()``, ``q.isInteger()``, ``q.asInteger()``, ``q.asApproximateFloat()``, ``q.add(q|int)``,
  ``q.sub(q|int)``.
* semver: ``semver(s)``, ``semver(s, normalize)``, ``isSemver(s)``, ``isSemver(s, normalize)``,
  ``v.compareTo(v)``, ``v.isGreaterThan(v)``, ``v.isLessThan(v)``, ``v.major()``, ``v.minor()``, ``v.patch()``.
* strings (cel-go ``ext.Strings``): ``charAt``, ``indexOf``, ``lastIndexOf``, ``lowerAscii``, ``upperAscii``,
  ``replace``, ``split``, ``substring``, ``trim``, ``join``.
* regex: ``find``, ``findAll``. lists: ``isSorted``, ``sum``, ``min``, ``max``, ``indexOf``, ``lastIndexOf``.
* sets: ``sets.contains``, ``sets.equivalent``, ``sets.intersects``. ``cel.bind(name, value, expr)``.
  ``includes`` (list-type attributes, 1.36).
* Heterogeneous equality and cross-type numeric comparison, as Kubernetes enables them: ``1 == 1.0`` is true,
  ``'a' == 1`` is false (celpy alone makes both errors).

Not available (celpy cannot parse or has no equivalent): optional syntax (``.?name``, ``orValue``),
two-variable comprehensions, ``format``/``quote``, URL/IP/CIDR libraries. An expression using one fails to
compile, naming the expression.

Kubernetes type-checks an expression when it is compiled; celpy does not. ``compile_selector`` parses and
then checks what can be checked without types: every identifier is ``device`` or a comprehension or
``cel.bind`` variable, every function and method is one the environment has. A misspelt variable or function
is a compile error here as it is in Kubernetes; a type mismatch (``device.driver > 1``) is only found when
the expression runs. Kubernetes' cost limit is not modelled.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import celpy
import re2
from celpy import celtypes as ct
from celpy.evaluation import Activation, CELEvalError, Evaluator, base_functions
from msgspec import Struct

from agent.sim.scheduler.errors import CELCompileError, CELRuntimeError
from agent.sim.scheduler.values import INT64_MAX, INT64_MIN, Quantity, Semver

MAX_EXPRESSION_LENGTH = 10 * 1024  # CELSelectorExpressionMaxLength
_MACROS = frozenset({"all", "exists", "exists_one", "map", "filter"})
_CELPY_MACROS = _MACROS | {"reduce", "min"}
_SETS = frozenset({"contains", "equivalent", "intersects"})

# celpy logs every evaluation step at DEBUG; the simulator's callers do not want that in their logs.
logging.getLogger("celpy").setLevel(logging.WARNING)


# ----- the device variable ------------------------------------------------------------------------


class _Domains(ct.MapType):
    """``device.attributes`` / ``device.capacity``: an unknown domain reads as an empty map, as in Kubernetes."""

    def __getitem__(self, key: Any) -> Any:
        try:
            return super().__getitem__(key)
        except KeyError:
            return ct.MapType()


class CelDevice(Struct, frozen=True):
    """One device as selectors see it, built once per device (``device_variable``)."""

    value: ct.MapType | None
    error: str | None = None  # an attribute Kubernetes cannot convert fails every selector for the device


def device_variable(device: Mapping[str, Any], driver: str) -> CelDevice:
    """The ``device`` variable for a ResourceSlice device entry (v1 shape; a v1beta1 ``basic`` is unwrapped)."""
    body = {**device, **device.get("basic", {})} if "basic" in device else device
    attributes: dict[str, dict[str, Any]] = {}
    for name, attribute in (body.get("attributes") or {}).items():
        domain, ident = _split_name(name, driver)
        try:
            attributes.setdefault(domain, {})[ident] = _attribute_value(attribute)
        except ValueError as error:
            return CelDevice(None, f"attribute {name}: {error}")
    capacity: dict[str, dict[str, Any]] = {}
    for name, entry in (body.get("capacity") or {}).items():
        domain, ident = _split_name(name, driver)
        raw = entry.get("value") if isinstance(entry, Mapping) else entry
        try:
            capacity.setdefault(domain, {})[ident] = Quantity.parse(str(raw))
        except ValueError as error:
            return CelDevice(None, f"capacity {name}: {error}")
    value = ct.MapType(
        {
            ct.StringType("driver"): ct.StringType(driver),
            ct.StringType("allowMultipleAllocations"): ct.BoolType(bool(body.get("allowMultipleAllocations"))),
            ct.StringType("attributes"): _Domains({ct.StringType(d): _map(v) for d, v in attributes.items()}),
            ct.StringType("capacity"): _Domains({ct.StringType(d): _map(v) for d, v in capacity.items()}),
        }
    )
    return CelDevice(value)


def _split_name(name: str, driver: str) -> tuple[str, str]:
    domain, sep, ident = name.partition("/")
    return (domain, ident) if sep else (driver, name)


def _map(values: Mapping[str, Any]) -> ct.MapType:
    return ct.MapType({ct.StringType(k): v for k, v in values.items()})


def _attribute_value(attribute: Mapping[str, Any]) -> Any:
    if "int" in attribute:
        return ct.IntType(attribute["int"])
    if "bool" in attribute:
        return ct.BoolType(bool(attribute["bool"]))
    if "string" in attribute:
        return ct.StringType(attribute["string"])
    if "version" in attribute:
        return _semver(attribute["version"])
    for key, convert in (("ints", ct.IntType), ("bools", ct.BoolType), ("strings", ct.StringType)):
        if key in attribute:
            return ct.ListType([convert(v) for v in attribute[key]])
    if "versions" in attribute:
        return ct.ListType([_semver(v) for v in attribute["versions"]])
    raise ValueError("unsupported attribute value")


def _semver(text: str) -> Semver:
    try:
        return Semver(text)
    except ValueError as error:
        raise ValueError(f"parse semantic version: {error}") from None


# ----- functions ----------------------------------------------------------------------------------


class _NoOverload(TypeError):
    """celpy turns a TypeError from a function into a "no such overload" evaluation error."""


def _want(value: Any, *types: type) -> Any:
    if isinstance(value, CELEvalError):
        raise _NoOverload(str(value))
    if not isinstance(value, types):
        raise _NoOverload(f"no such overload for {type(value).__name__}")
    return value


def _compare(a: Any, b: Any) -> int:
    if isinstance(a, Quantity) and isinstance(b, Quantity):
        return a.compare(b)
    if isinstance(a, Semver) and isinstance(b, Semver):
        return a.compare(b)
    raise _NoOverload(f"no such overload: {type(a).__name__}.compareTo({type(b).__name__})")


def _quantity(text: Any) -> Quantity:
    return Quantity.parse(str(_want(text, ct.StringType)))  # ValueError: an evaluation error, as in Kubernetes


def _is_quantity(text: Any) -> ct.BoolType:
    try:
        Quantity.parse(str(_want(text, ct.StringType)))
    except ValueError:
        return ct.BoolType(False)
    return ct.BoolType(True)


def _to_semver(text: Any, normalize: Any = None) -> Semver:
    return Semver.parse(str(_want(text, ct.StringType)), bool(normalize))


def _is_semver(text: Any, normalize: Any = None) -> ct.BoolType:
    try:
        _to_semver(text, normalize)
    except ValueError:
        return ct.BoolType(False)
    return ct.BoolType(True)


def _int64(value: int) -> ct.IntType:
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError("integer overflow")
    return ct.IntType(value)


def _add(q: Any, other: Any) -> Quantity:
    return _want(q, Quantity).plus(_want(other, Quantity, ct.IntType))


def _sub(q: Any, other: Any) -> Quantity:
    return _want(q, Quantity).minus(_want(other, Quantity, ct.IntType))


def _index_of(target: Any, item: Any, start: Any = None) -> ct.IntType:
    if isinstance(target, ct.ListType):
        for i, element in enumerate(target):
            if _same(element, item):
                return ct.IntType(i)
        return ct.IntType(-1)
    text, sub = str(_want(target, ct.StringType)), str(_want(item, ct.StringType))
    begin = int(start) if start is not None else 0
    if not 0 <= begin <= len(text):
        raise ValueError(f"index out of range: {begin}")
    return ct.IntType(text.find(sub, begin))


def _last_index_of(target: Any, item: Any, end: Any = None) -> ct.IntType:
    if isinstance(target, ct.ListType):
        for i in range(len(target) - 1, -1, -1):
            if _same(target[i], item):
                return ct.IntType(i)
        return ct.IntType(-1)
    text, sub = str(_want(target, ct.StringType)), str(_want(item, ct.StringType))
    last = int(end) if end is not None else len(text)
    if not 0 <= last <= len(text):
        raise ValueError(f"index out of range: {last}")
    return ct.IntType(text.rfind(sub, 0, last + len(sub)))


def _char_at(text: Any, index: Any) -> ct.StringType:
    s, i = str(_want(text, ct.StringType)), int(_want(index, ct.IntType))
    if not 0 <= i <= len(s):
        raise ValueError(f"index out of range: {i}")
    return ct.StringType(s[i : i + 1])


def _substring(text: Any, start: Any, end: Any = None) -> ct.StringType:
    s = str(_want(text, ct.StringType))
    begin, stop = int(start), len(s) if end is None else int(end)
    if not 0 <= begin <= stop <= len(s):
        raise ValueError(f"index out of range: {begin}..{stop}")
    return ct.StringType(s[begin:stop])


def _replace(text: Any, old: Any, new: Any, count: Any = None) -> ct.StringType:
    n = -1 if count is None else int(count)
    return ct.StringType(str(_want(text, ct.StringType)).replace(str(old), str(new), n))


def _split(text: Any, separator: Any, count: Any = None) -> ct.ListType:
    s, sep = str(_want(text, ct.StringType)), str(_want(separator, ct.StringType))
    n = -1 if count is None else int(count)
    if n == 0:
        return ct.ListType()
    parts = list(s) if sep == "" else s.split(sep, n - 1 if n > 0 else -1)
    if sep == "" and n > 0 and len(parts) > n:
        parts = [*parts[: n - 1], "".join(parts[n - 1 :])]
    return ct.ListType([ct.StringType(p) for p in parts])


def _join(items: Any, separator: Any = None) -> ct.StringType:
    sep = "" if separator is None else str(separator)
    return ct.StringType(sep.join(str(_want(i, ct.StringType)) for i in _want(items, ct.ListType)))


def _ascii(convert: Callable[[str], str]) -> Callable[[Any], ct.StringType]:
    def apply(text: Any) -> ct.StringType:
        return ct.StringType("".join(convert(c) if c.isascii() else c for c in str(_want(text, ct.StringType))))

    return apply


def _find(text: Any, pattern: Any) -> ct.StringType:
    match = re2.search(str(_want(pattern, ct.StringType)), str(_want(text, ct.StringType)))
    return ct.StringType(match.group(0) if match else "")


def _find_all(text: Any, pattern: Any, limit: Any = None) -> ct.ListType:
    found = [m.group(0) for m in re2.finditer(str(_want(pattern, ct.StringType)), str(_want(text, ct.StringType)))]
    if limit is not None and int(limit) >= 0:
        found = found[: int(limit)]
    return ct.ListType([ct.StringType(f) for f in found])


def _numbers(items: Any) -> list[Any]:
    return list(_want(items, ct.ListType))


def _sum(items: Any) -> Any:
    values = _numbers(items)
    if not values:
        return ct.IntType(0)
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total


def _max(items: Any) -> Any:
    values = _numbers(items)
    if not values:
        raise ValueError("max called on an empty list")
    return max(values)


def _is_sorted(items: Any) -> ct.BoolType:
    values = _numbers(items)
    return ct.BoolType(all(not (values[i + 1] < values[i]) for i in range(len(values) - 1)))


def _includes(target: Any, item: Any) -> ct.BoolType:
    if isinstance(target, ct.ListType):
        return ct.BoolType(any(_same(element, item) for element in target))
    return ct.BoolType(_same(target, item))


def _sets_contains(a: Any, b: Any) -> ct.BoolType:
    first = _want(a, ct.ListType)
    return ct.BoolType(all(any(_same(x, y) for x in first) for y in _want(b, ct.ListType)))


def _sets_intersects(a: Any, b: Any) -> ct.BoolType:
    first = _want(a, ct.ListType)
    return ct.BoolType(any(any(_same(x, y) for x in first) for y in _want(b, ct.ListType)))


def _sets_equivalent(a: Any, b: Any) -> ct.BoolType:
    return ct.BoolType(bool(_sets_contains(a, b)) and bool(_sets_contains(b, a)))


# Heterogeneous equality (cel-go, as Kubernetes runs it): values of different kinds are unequal, numbers
# compare across int, uint and double.
_NUMBERS = (ct.IntType, ct.UintType, ct.DoubleType)
_KINDS: tuple[type, ...] = (
    ct.BoolType,
    ct.StringType,
    ct.BytesType,
    ct.ListType,
    ct.MapType,
    Quantity,
    Semver,
    ct.TimestampType,
    ct.DurationType,
    type(None),
)


def _kind(value: Any) -> type | None:
    for kind in _KINDS:
        if isinstance(value, kind):
            return kind
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, _NUMBERS)


def _number(value: Any) -> int | float:
    return float(value) if isinstance(value, ct.DoubleType) else int(value)


def _same(a: Any, b: Any) -> bool:
    result = _equal(a, b)
    return isinstance(result, ct.BoolType) and bool(result)


def _equal(a: Any, b: Any) -> Any:
    if isinstance(a, CELEvalError):
        return a
    if isinstance(b, CELEvalError):
        return b
    if _is_number(a) and _is_number(b):
        return ct.BoolType(_number(a) == _number(b))  # Python compares int and float exactly
    kind = _kind(a)
    if kind is None or kind is not _kind(b):
        return ct.BoolType(False)
    if kind is ct.ListType:
        return ct.BoolType(len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True)))
    if kind is ct.MapType:
        return ct.BoolType(a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a))
    try:
        return ct.BoolType(bool(a == b))
    except TypeError:
        return ct.BoolType(False)


def _not_equal(a: Any, b: Any) -> Any:
    result = _equal(a, b)
    return result if isinstance(result, CELEvalError) else ct.BoolType(not result)


def _ordering(name: str) -> Callable[[Any, Any], Any]:
    base = base_functions[name]

    def compare(a: Any, b: Any) -> Any:
        if _is_number(a) and _is_number(b) and type(a) is not type(b):
            x, y = _number(a), _number(b)
            return ct.BoolType({"_<_": x < y, "_<=_": x <= y, "_>_": x > y, "_>=_": x >= y}[name])
        return base(a, b)

    return compare


def _in(item: Any, container: Any) -> Any:
    if isinstance(item, CELEvalError):
        return item
    if isinstance(container, CELEvalError):
        return container
    if isinstance(container, ct.MapType):
        return ct.BoolType(any(_same(key, item) for key in container))
    return ct.BoolType(any(_same(element, item) for element in _want(container, ct.ListType)))


def _index(container: Any, key: Any) -> Any:
    """``a[b]`` with an error operand is that error (celpy reports "no matching overload for _[_]" instead)."""
    if isinstance(container, CELEvalError):
        return container
    if isinstance(key, CELEvalError):
        return key
    return container[key]


# celpy looks functions and methods up by name only, whatever the receiver: the functions below that two
# libraries share (compareTo for quantities and versions, indexOf for strings and lists) dispatch on type.

FUNCTIONS: dict[str, Callable[..., Any]] = {
    "_==_": _equal,
    "_!=_": _not_equal,
    "_<_": _ordering("_<_"),
    "_<=_": _ordering("_<=_"),
    "_>_": _ordering("_>_"),
    "_>=_": _ordering("_>=_"),
    "_in_": _in,
    "_[_]": _index,
    # quantity and semver (k8s.io/apiserver/pkg/cel/library)
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "semver": _to_semver,
    "isSemver": _is_semver,
    "compareTo": lambda a, b: ct.IntType(_compare(a, b)),
    "isGreaterThan": lambda a, b: ct.BoolType(_compare(a, b) > 0),
    "isLessThan": lambda a, b: ct.BoolType(_compare(a, b) < 0),
    "sign": lambda q: ct.IntType(_want(q, Quantity).sign()),
    "isInteger": lambda q: ct.BoolType(_want(q, Quantity).is_integer()),
    "asInteger": lambda q: _int64(_want(q, Quantity).as_integer()),
    "asApproximateFloat": lambda q: ct.DoubleType(_want(q, Quantity).as_float()),
    "add": _add,
    "sub": _sub,
    "major": lambda v: ct.IntType(_want(v, Semver).major),
    "minor": lambda v: ct.IntType(_want(v, Semver).minor),
    "patch": lambda v: ct.IntType(_want(v, Semver).patch),
    # strings (cel-go ext.Strings)
    "charAt": _char_at,
    "indexOf": _index_of,
    "lastIndexOf": _last_index_of,
    "lowerAscii": _ascii(str.lower),
    "upperAscii": _ascii(str.upper),
    "replace": _replace,
    "split": _split,
    "substring": _substring,
    "trim": lambda s: ct.StringType(str(_want(s, ct.StringType)).strip()),
    "join": _join,
    # regex and lists (k8s.io/apiserver/pkg/cel/library)
    "find": _find,
    "findAll": _find_all,
    "isSorted": _is_sorted,
    "sum": _sum,
    "max": _max,
    # list-type attributes (DRAListTypeAttributes)
    "includes": _includes,
}
_NAMESPACED: dict[tuple[str, str], Callable[..., Any]] = {
    ("sets", "contains"): _sets_contains,
    ("sets", "equivalent"): _sets_equivalent,
    ("sets", "intersects"): _sets_intersects,
}
_GLOBALS = frozenset(FUNCTIONS) | frozenset(base_functions) | {"has", "dyn"}
_MEMBERS = frozenset(FUNCTIONS) | frozenset(base_functions) | _CELPY_MACROS


# ----- evaluation ---------------------------------------------------------------------------------


def _namespace(tree: Any) -> str | None:
    """``cel`` in ``cel.bind(...)``, ``sets`` in ``sets.contains(...)``: a bare identifier as a receiver."""
    if getattr(tree, "data", None) != "member" or len(tree.children) != 1:
        return None
    primary = tree.children[0]
    if getattr(primary, "data", None) != "primary" or len(primary.children) != 1:
        return None
    ident = primary.children[0]
    if getattr(ident, "data", None) != "ident":
        return None
    return str(ident.children[0].value)


class _Evaluator(Evaluator):
    """celpy's evaluator plus ``cel.bind`` and ``sets.*``, which need a namespace celpy does not have."""

    def sub_evaluator(self, ast: Any) -> Evaluator:
        return _Evaluator(ast, activation=self.activation)

    def member_dot_arg(self, tree: Any) -> Any:
        receiver, method = tree.children[0], tree.children[1].value
        namespace = _namespace(receiver)
        if namespace == "cel" and method == "bind":
            return self._bind(tree)
        if namespace == "sets" and method in _SETS:
            values = self.visit(tree.children[2]) if len(tree.children) > 2 else []
            if isinstance(values, CELEvalError):
                return values
            try:
                return _NAMESPACED["sets", method](*values)
            except (TypeError, ValueError) as error:
                return CELEvalError("no such overload", type(error), error.args)
        return super().member_dot_arg(tree)

    def _bind(self, tree: Any) -> Any:
        args = tree.children[2].children
        name = str(next(args[0].find_data("ident")).children[0].value)
        value = self.visit(args[1])
        if isinstance(value, CELEvalError):
            return value
        try:
            return self.sub_evaluator(args[2]).evaluate({name: value})
        except CELEvalError as error:
            return error


_ENVIRONMENT = celpy.Environment()


class Selector(Struct, frozen=True):
    """A compiled selector: ``matches(device)`` is True or False, or raises ``CELRuntimeError``."""

    expression: str
    ast: Any

    def matches(self, device: CelDevice) -> bool:
        if device.error is not None:
            raise CELRuntimeError(self.expression, device.error)
        activation = Activation(functions=FUNCTIONS)  # no protobuf wrapper types: selectors never name them
        evaluator = _Evaluator(self.ast, activation=activation)
        try:
            result = evaluator.evaluate({"device": device.value})
        except CELEvalError as error:
            raise CELRuntimeError(self.expression, _describe(error)) from None
        except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as error:
            raise CELRuntimeError(self.expression, f"{type(error).__name__}: {error}") from None
        if not isinstance(result, ct.BoolType):
            raise CELRuntimeError(
                self.expression, f"CEL result of type {_type_name(result)} could not be converted to bool"
            )
        return bool(result)


def compile_selector(expression: str) -> Selector:
    """The compiled selector, from a cache: an expression is parsed and checked once, and so is a failure,
    which raises the same ``CELCompileError`` (naming the expression) every time it is asked for."""
    result = _compile(expression)
    if isinstance(result, CELCompileError):
        raise result
    return result


@functools.lru_cache(maxsize=1024)
def _compile(expression: str) -> Selector | CELCompileError:
    if not isinstance(expression, str) or not expression.strip():
        return CELCompileError(str(expression), "the expression is empty")
    if len(expression.encode()) > MAX_EXPRESSION_LENGTH:
        return CELCompileError(
            expression[:60] + "...", f"{len(expression.encode())} bytes; at most {MAX_EXPRESSION_LENGTH} are allowed"
        )
    try:
        ast = _ENVIRONMENT.compile(expression)
    except celpy.CELParseError as error:
        return CELCompileError(expression, "syntax error: " + _parse_message(error))
    problem = _check(ast)
    if problem is not None:
        return CELCompileError(expression, problem)
    return Selector(expression, ast)


def _check(ast: Any) -> str | None:
    """What cel-go's checker would reject without knowing types: unknown names, functions and methods."""
    bound = {"device"}
    receivers: set[int] = set()
    for node in ast.iter_subtrees():
        if node.data != "member_dot_arg":
            continue
        method = str(node.children[1].value)
        namespace = _namespace(node.children[0])
        if namespace in ("cel", "sets"):
            receivers.add(id(node.children[0].children[0].children[0]))
        if (method in _CELPY_MACROS and method not in ("min", "reduce")) or (namespace == "cel" and method == "bind"):
            args = node.children[2].children if len(node.children) > 2 else []
            if args:
                bound.update(str(ident.children[0].value) for ident in args[0].find_data("ident"))
    for node in ast.iter_subtrees():
        if node.data == "ident" and id(node) not in receivers:
            name = str(node.children[0].value)
            if name not in bound:
                return f"undeclared reference to '{name}'"
        elif node.data == "ident_arg":
            name = str(node.children[0].value)
            if name not in _GLOBALS:
                return f"undeclared reference to '{name}'"
        elif node.data == "member_dot_arg":
            method = str(node.children[1].value)
            namespace = _namespace(node.children[0])
            if (namespace == "cel" and method != "bind") or (namespace == "sets" and method not in _SETS):
                return f"undeclared reference to '{namespace}.{method}'"
            if namespace not in ("cel", "sets") and method not in _MEMBERS:
                return f"undeclared reference to '{method}'"
        elif node.data in ("dot_ident", "dot_ident_arg", "member_object"):
            return "message types and root-scoped names are not part of the DRA environment"
    return None


def _parse_message(error: Exception) -> str:
    lines = [line.rstrip() for line in str(error).splitlines() if line.strip()]
    return " | ".join(lines) if lines else type(error).__name__


_OPERATORS = {
    "relation_lt": "_<_",
    "relation_le": "_<=_",
    "relation_gt": "_>_",
    "relation_ge": "_>=_",
    "relation_eq": "_==_",
    "relation_ne": "_!=_",
    "relation_in": "@in",
    "addition_add": "_+_",
    "addition_sub": "_-_",
    "multiplication_mul": "_*_",
    "multiplication_div": "_/_",
    "multiplication_mod": "_%_",
}
_CEL_TYPES = {
    "BoolType": "bool",
    "IntType": "int",
    "UintType": "uint",
    "DoubleType": "double",
    "StringType": "string",
    "BytesType": "bytes",
    "ListType": "list",
    "MapType": "map",
    "Quantity": "kubernetes.Quantity",
    "Semver": "kubernetes.Semver",
    "NoneType": "null_type",
}


def _describe(error: CELEvalError) -> str:
    """celpy's error in the words cel-go uses, so messages read like the kube-scheduler's."""
    message = str(error.args[0]) if error.args else "evaluation error"
    cause = error.args[1] if len(error.args) > 1 else None
    details = error.args[2] if len(error.args) > 2 else None
    if cause is KeyError or message.startswith("no such member in mapping"):
        key = message.split(":", 1)[1].strip().strip("'") if ":" in message else _first(details)
        return f"no such key: {key}"
    overload = re.match(r"found no matching overload for (?:Token\('RULE', )?'(\w+)'\)? applied to '\((.*)\)'", message)
    if overload:
        operator = _OPERATORS.get(overload[1], overload[1])
        types = re.findall(r"<class '[\w.]*?(\w+)'>", overload[2])
        return f"no matching overload for '{operator}' applied to '({', '.join(_CEL_TYPES.get(t, t) for t in types)})'"
    if message == "no such overload" and details:
        missing = re.match(r"'(\w+)' object has no attribute '(\w+)'", _first(details))
        if missing:
            return f"no such overload: {_CEL_TYPES.get(missing[1], missing[1])}.{missing[2]}()"
        return f"no such overload: {_first(details)}"
    if details and message in ("return error for overflow", "match error"):
        return f"{_first(details)}"
    return message


def _first(values: Iterable[Any] | None) -> str:
    for value in values or ():
        return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return ""


def _type_name(value: Any) -> str:
    names = {ct.StringType: "string", ct.IntType: "int", ct.UintType: "uint", ct.DoubleType: "double"}
    names |= {ct.ListType: "list", ct.MapType: "map", Quantity: "kubernetes.Quantity", Semver: "kubernetes.Semver"}
    return names.get(type(value), type(value).__name__)
