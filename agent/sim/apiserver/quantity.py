"""``resource.Quantity`` parsing and the canonical form the API server stores and returns.

The server re-serialises every quantity it decodes (``Quantity.CanonicalizeBytes``): ``"81920Mi"`` comes back as
``"80Gi"``, ``"1000"`` as ``"1k"``, ``0.5`` as ``"500m"``, ``"512Ki"`` stays. A driver that compares what it wrote
with what it reads back must compare canonical forms, so the stand-in rewrites quantities the same way.
Precision below 1n is rounded up, as the real parser does.
"""

from __future__ import annotations

import contextlib
import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation

_PATTERN = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {v: k for k, v in _DECIMAL.items()}
_NANO = Decimal("1e-9")


def parse(value: object) -> tuple[Decimal, str]:
    """(amount, format) with format ``BinarySI``, ``DecimalSI`` or ``DecimalExponent``; ValueError if invalid."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"not a quantity: {value!r}")
    text = str(value).strip() if not isinstance(value, float) else repr(value)
    match = _PATTERN.fullmatch(text)
    if not match:
        raise ValueError(
            f"quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$': {text!r}"
        )
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as e:
        raise ValueError(f"not a quantity: {text!r}") from e
    suffix = match.group(2) or ""
    if suffix in _BINARY:
        return number * (Decimal(1024) ** _BINARY[suffix]), "BinarySI"
    if suffix in _DECIMAL:
        return number.scaleb(_DECIMAL[suffix]), "DecimalSI"
    return number.scaleb(int(suffix[1:])), "DecimalExponent"


def canonical(value: object) -> str:
    amount, fmt = parse(value)
    amount = (amount / _NANO).to_integral_value(rounding=ROUND_CEILING) * _NANO  # round up to nano precision
    if amount == 0:
        return "0"
    if fmt == "BinarySI" and (-1024 < amount < 1024 or amount != amount.to_integral_value()):
        fmt = "DecimalSI"
    if fmt == "BinarySI":
        integer = int(amount)
        power = 0
        while power < 6 and integer % (1024 ** (power + 1)) == 0:
            power += 1
        suffix = {v: k for k, v in _BINARY.items()}.get(power, "")
        return f"{integer // (1024**power)}{suffix}"
    # mantissa * 10^exponent with an integer mantissa that has no trailing zeros
    sign, digits, exponent = amount.normalize().as_tuple()
    mantissa = int("".join(map(str, digits))) * (-1 if sign else 1)
    assert isinstance(exponent, int)
    exp3 = max(-9, min(18, (exponent // 3) * 3))
    mantissa = mantissa * 10 ** (exponent - exp3) if exponent >= exp3 else mantissa // 10 ** (exp3 - exponent)
    if fmt == "DecimalExponent":
        return f"{mantissa}e{exp3}" if exp3 else str(mantissa)
    return f"{mantissa}{_DECIMAL_SUFFIX[exp3]}"


def canonicalize_map(values: object) -> None:
    """Rewrite, in place, a ``{name: {"value": q}}`` map (capacities, counters); invalid ones are left for
    validation to report."""
    if not isinstance(values, dict):
        return
    for entry in values.values():
        if isinstance(entry, dict) and "value" in entry:
            with contextlib.suppress(ValueError):  # an invalid one is left for validation to report
                entry["value"] = canonical(entry["value"])


def canonicalize_plain(values: object) -> None:
    """Rewrite, in place, a ``{name: q}`` map (node capacity, capacity requests)."""
    if not isinstance(values, dict):
        return
    for name, value in values.items():
        with contextlib.suppress(ValueError):
            values[name] = canonical(value)
