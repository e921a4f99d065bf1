"""Numbers a user writes — Kubernetes quantities, and the plain numbers of flags — read within bounds.

A quantity (``1Gi``, ``512Mi``, ``1.5G``, ``1e9``, ``100m``) is scanned as Kubernetes' ``resource.ParseQuantity``
(k8s.io/apimachinery/pkg/api/resource/quantity.go) scans it, left to right, without a regular expression::

    <quantity>        ::= <sign>? <number> <suffix>             <sign> ::= "+" | "-"
    <number>          ::= <digits> | <digits>. | <digits>.<digits> | .<digits>
    <suffix>          ::= <binarySI> | <decimalSI> | <decimalExponent>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei                  (2^10 .. 2^60)
    <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E       (10^-9 .. 10^18)
    <decimalExponent> ::= (e | E) <sign>? <digits>                  (an int64, as Go's strconv.ParseInt reads it)

and its value is the one Kubernetes keeps: exact, rounded up (away from zero) to a whole nano (``1e-12`` is ``1n``).

The bound comes first. Before any arithmetic, the value's order of magnitude is read off the count of its digits
and its exponent, and a value that cannot fit ``limit`` (at most the int64 range: every number here ends up as
bytes, a count or a percentage) is refused, as is a mantissa of more than ``MAX_DIGITS`` significant digits. So
``1e10000000`` is refused at once, where exact arithmetic would first build a ten-million-digit power of ten
(seconds of CPU, holding the GIL: every thread of the agent stops). Kubernetes stores such a quantity as a scaled
decimal (and caps a binary one at 2^63-1 without a word, and wraps an exponent beyond 32 bits); nothing Tessera
does with a number could use it.

Where this parser is stricter than Kubernetes', on purpose: a number without digits (``Ki``, ``.``, ``-``, which
Kubernetes reads as 0) is refused; a value beyond ``limit`` is refused rather than capped. Leading and trailing
white space is ignored, as Quantity's JSON decoding does.

Plain numbers (:func:`parse_number`: a flag's seconds or percent) are decimal, finite, within a given range.

Pure: no I/O. Every refusal is a ``QuantityError`` (a ``ValueError``) whose message names the text and the bound.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fractions import Fraction  # imported where a quantity is parsed: with decimal, ~0.3 MB a flag does not need

MAX_INT64 = (1 << 63) - 1
MAX_DIGITS = 100  # significant digits of a mantissa; a real quantity has a handful
MAX_NUMBER_TEXT = 64  # characters of a plain number (a flag's value)
NANO = 10**9  # Kubernetes keeps a quantity to 1n, rounding up
EXAMPLES = "write e.g. 1Gi, 512Mi, 2G or 1073741824"

_DIGITS = frozenset("0123456789")
_SUFFIX_LETTERS = frozenset("eEinumkKMGTP")  # what Kubernetes' scanner takes into a suffix
_BINARY_SI = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}  # exponents of 2
_DECIMAL_SI = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}  # of 10
_INT64_DIGITS = 19  # an int64 has at most 19 decimal digits
_TINY = -30  # below 10^-30 a value (times at most 2^60) is under 1n: Kubernetes rounds it up to 1n
_SHOWN = 40  # characters of an offending text shown in a message


class QuantityError(ValueError):
    """The text is not a quantity (or number) within bounds; the message says what it is and what is allowed.
    ``out_of_range``: it is one, but beyond the limit (a caller may say its own range instead)."""

    def __init__(self, message: str, *, out_of_range: bool = False) -> None:
        super().__init__(message)
        self.out_of_range = out_of_range


def parse_quantity(
    text: str | int | float, *, limit: int = MAX_INT64, what: str = "quantity", hint: str = EXAMPLES
) -> Fraction:
    """A Kubernetes quantity as the exact value Kubernetes keeps (rounded up to 1n), ``-limit <= value <= limit``.

    ``text`` may be a JSON number as well (an int is taken as is, a float as Python writes it). Raises
    ``QuantityError`` (``'ten' is not a <what>: ...; <hint>``); takes microseconds, whatever the text.
    """
    from fractions import Fraction

    if not 0 <= limit <= MAX_INT64:
        raise ValueError(f"limit {limit} is outside 0..{MAX_INT64}")  # a bug of the caller, not the user's text
    if isinstance(text, bool):
        raise QuantityError(f"{text!r} is not a {what}: {hint}")
    if isinstance(text, int):  # a JSON or YAML integer: bounded without turning it into text
        if abs(text) > limit:
            raise QuantityError(_beyond(_shown_int(text), text < 0, limit), out_of_range=True)
        return Fraction(text)
    if isinstance(text, float):
        if not math.isfinite(text):
            raise QuantityError(f"{text!r} is not a {what}: {hint}")
        text = repr(text)  # 1e+20, 1500.0: both quantities
    if not isinstance(text, str):
        raise QuantityError(f"a {type(text).__name__} is not a {what}: {hint}")
    shown = _shown(text)
    try:
        negative, whole, fraction, suffix = _scan(text.strip())
        base, exponent = _interpret(suffix)
    except _NotAQuantity as error:
        raise QuantityError(f"{shown} is not a {what}: {error}; {hint}") from None
    digits = (whole + fraction).lstrip("0")
    if not digits:
        return Fraction(0)
    # |value| = int(digits) * 10**scale * 2**binary, with digits free of leading and trailing zeros
    significant = digits.rstrip("0")
    scale = (exponent if base == 10 else 0) - len(fraction) + len(digits) - len(significant)
    binary = exponent if base == 2 else 0
    top = len(significant) - 1 + scale  # 10**top <= |value| / 2**binary < 10**(top + 1)
    if top >= _INT64_DIGITS:  # |value| >= 10**19 > 2**63 > limit: refused before anything is computed
        raise QuantityError(_beyond(shown, negative, limit), out_of_range=True)
    if top < _TINY:
        return Fraction(-1 if negative else 1, NANO)
    if len(significant) > MAX_DIGITS:
        raise QuantityError(
            f"{shown} has {len(significant)} significant digits: a {what} may have at most {MAX_DIGITS}"
        )
    # small numbers from here: |scale| <= MAX_DIGITS - _TINY, binary <= 60
    magnitude = Fraction(int(significant) << binary) * Fraction(10) ** scale
    magnitude = Fraction(math.ceil(magnitude * NANO), NANO)  # Kubernetes: inf.RoundUp to scale 9
    if magnitude > limit:
        raise QuantityError(_beyond(shown, negative, limit), out_of_range=True)
    return -magnitude if negative else magnitude


def quantity_value(
    text: str | int | float, *, limit: int = MAX_INT64, what: str = "quantity", hint: str = EXAMPLES
) -> int:
    """Go's ``Quantity.Value()``: the quantity rounded up (away from zero) to a whole number (bytes, say)."""
    value = parse_quantity(text, limit=limit, what=what, hint=hint)
    return math.ceil(value) if value >= 0 else -math.ceil(-value)


def parse_number(text: str, *, minimum: float, maximum: float) -> float:
    """A plain decimal number (``10``, ``0.5``, ``1e3``) from ``minimum`` to ``maximum``: finite, never ``nan``."""
    span = f"give one from {minimum:g} to {maximum:g}"
    shown = _shown(text)
    if len(text) > MAX_NUMBER_TEXT or not text.isascii():
        raise QuantityError(f"{shown} is not a number; {span}")
    try:
        value = float(text)
    except ValueError:
        raise QuantityError(f"{shown} is not a number; {span}") from None
    if not math.isfinite(value):
        raise QuantityError(f"{shown} is not a finite number; {span}")
    if not minimum <= value <= maximum:
        raise QuantityError(f"{shown} is out of range; {span}")
    return value


def describe(limit: int) -> str:
    """A bound as a message gives it: ``17592186044416 (16Ti)``."""
    if limit == MAX_INT64:
        return f"{limit} (2^63 - 1, the largest int64)"
    for suffix, power in reversed(_BINARY_SI.items()):
        if limit >= 1 << power and limit % (1 << power) == 0:
            return f"{limit} ({limit >> power}{suffix})"
    return str(limit)


# ----- scanning ---------------------------------------------------------------------------------------------------


class _NotAQuantity(Exception):
    """Why a text is not a quantity at all (no digits, a bad suffix...), without the text."""


def _scan(text: str) -> tuple[bool, str, str, str]:
    """Sign, whole digits, fraction digits and suffix, as Kubernetes' ``parseQuantityString`` splits them."""
    end = len(text)
    pos = 0
    negative = False
    if pos < end and text[pos] in "+-":
        negative = text[pos] == "-"
        pos += 1
    start = pos
    while pos < end and text[pos] in _DIGITS:
        pos += 1
    whole = text[start:pos]
    fraction = ""
    if pos < end and text[pos] == ".":
        pos += 1
        start = pos
        while pos < end and text[pos] in _DIGITS:
            pos += 1
        fraction = text[start:pos]
    if not whole and not fraction:
        raise _NotAQuantity("it has no digits")
    suffix_start = pos
    while pos < end and text[pos] in _SUFFIX_LETTERS:
        pos += 1
    if pos < end and text[pos] in "+-":
        pos += 1
    while pos < end and text[pos] in _DIGITS:
        pos += 1
    if pos < end:
        found = "white space inside" if text[pos].isspace() else f"{text[pos]!r} at position {pos + 1}"
        raise _NotAQuantity(found)
    return negative, whole, fraction, text[suffix_start:]


def _interpret(suffix: str) -> tuple[int, int]:
    """``(base, exponent)`` of a suffix, as Kubernetes' ``suffixHandler.interpret``."""
    if suffix in _DECIMAL_SI:
        return 10, _DECIMAL_SI[suffix]
    if suffix in _BINARY_SI:
        return 2, _BINARY_SI[suffix]
    if len(suffix) > 1 and suffix[0] in "eE":
        text = suffix[1:]
        digits = text[1:] if text[:1] in ("+", "-") else text
        if digits and all(c in _DIGITS for c in digits):
            exponent = int(text) if len(digits.lstrip("0")) <= _INT64_DIGITS else None
            if exponent is None or not -MAX_INT64 - 1 <= exponent <= MAX_INT64:
                raise _NotAQuantity("its exponent does not fit in 64 bits")
            return 10, exponent
    raise _NotAQuantity(
        f"unknown suffix {_shown(suffix)} (use Ki, Mi, Gi, Ti, Pi, Ei, n, u, m, k, M, G, T, P, E or e<n>)"
    )


def _beyond(shown: str, negative: bool, limit: int) -> str:
    if negative:
        return f"{shown} is too small: the least allowed here is -{describe(limit)}"
    return f"{shown} is too large: the most allowed here is {describe(limit)}"


def _shown(text: str) -> str:
    if len(text) <= _SHOWN:
        return repr(text)
    return f"{text[:_SHOWN]!r}... ({len(text)} characters)"


def _shown_int(value: int) -> str:
    """An integer of any size, shown without converting all of it to text (Python refuses above 4,300 digits)."""
    if value.bit_length() <= 128:
        return str(value)
    return f"a {'negative ' if value < 0 else ''}number of about {int(value.bit_length() * math.log10(2))} digits"
