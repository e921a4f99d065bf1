"""The two value types Kubernetes adds to CEL for DRA selectors: ``Quantity`` and ``Semver``.

Written from ``k8s.io/apiserver/pkg/cel/library`` (``quantity.go``, ``semverlib.go``) and the parsers they wrap
(``resource.ParseQuantity``, ``blang/semver`` ``Parse``): what parses, how values compare and what the scalar
conversions return. Neither type has ordering operators (Kubernetes rejects ``quantity(...) < quantity(...)``
when it type-checks; here it is a runtime error): comparisons go through ``compareTo``, ``isGreaterThan`` and
``isLessThan``. Equality is by value (``quantity('1Gi') == quantity('1024Mi')``; a version's build metadata does
not take part). Amounts are exact (``Fraction``), never floats.
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import total_ordering

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# resource.ParseQuantity: <signed number><suffix>; the suffix is binary SI, decimal SI or a decimal exponent.
_QUANTITY = re.compile(r"([+-]?)(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?")
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_QUANTITY_ERROR = "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"


class Quantity:
    """A ``resource.Quantity`` as CEL sees it: an exact amount, the text it came from kept for messages."""

    __slots__ = ("amount", "text")

    def __init__(self, amount: Fraction, text: str) -> None:
        self.amount = amount
        self.text = text

    @classmethod
    def parse(cls, text: str) -> Quantity:
        """``ValueError`` with the API server's message when ``text`` is not a quantity (``200K``, ``Mi``)."""
        match = _QUANTITY.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ValueError(_QUANTITY_ERROR)
        sign, number, suffix = match[1], Fraction(match[2]), match[3] or ""
        if suffix in _BINARY:
            amount = number * (1 << _BINARY[suffix])
        elif suffix in _DECIMAL:
            amount = number * Fraction(10) ** _DECIMAL[suffix]
        else:
            amount = number * Fraction(10) ** int(suffix[1:])
        return cls(-amount if sign == "-" else amount, text)

    def compare(self, other: Quantity) -> int:
        return (self.amount > other.amount) - (self.amount < other.amount)

    def sign(self) -> int:
        return (self.amount > 0) - (self.amount < 0)

    def is_integer(self) -> bool:
        """``AsInt64`` succeeds: a whole number of units that fits in 64 bits."""
        return self.amount.denominator == 1 and INT64_MIN <= self.amount <= INT64_MAX

    def as_integer(self) -> int:
        if not self.is_integer():
            raise ValueError("cannot convert value to integer")
        return int(self.amount)

    def as_float(self) -> float:
        try:
            return float(self.amount)
        except OverflowError:
            return float("inf") if self.amount > 0 else float("-inf")

    def plus(self, other: Quantity | int) -> Quantity:
        amount = self.amount + (other.amount if isinstance(other, Quantity) else other)
        return Quantity(amount, _text(amount))

    def minus(self, other: Quantity | int) -> Quantity:
        amount = self.amount - (other.amount if isinstance(other, Quantity) else other)
        return Quantity(amount, _text(amount))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Quantity):
            return NotImplemented
        return self.amount == other.amount

    def __hash__(self) -> int:
        return hash(self.amount)

    def __repr__(self) -> str:
        return f"quantity({self.text!r})"

    def __str__(self) -> str:
        return self.text


def _text(amount: Fraction) -> str:
    return str(amount.numerator) if amount.denominator == 1 else str(float(amount))


# semver 2.0.0 as blang/semver v4 Parse accepts it: MAJOR.MINOR.PATCH, no leading zeros, optional pre-release
# and build metadata.
_NUMERIC = r"0|[1-9]\d*"
_PRE_IDENT = r"0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*"
_SEMVER = re.compile(
    rf"({_NUMERIC})\.({_NUMERIC})\.({_NUMERIC})"
    rf"(?:-((?:{_PRE_IDENT})(?:\.(?:{_PRE_IDENT}))*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
)


@total_ordering
class _PreRelease:
    """Pre-release precedence (semver 2.0.0 §11): numeric identifiers numerically and below alphanumeric ones,
    alphanumeric ones in ASCII order, a shorter list first when it is a prefix of the longer."""

    __slots__ = ("parts",)

    def __init__(self, text: str) -> None:
        self.parts = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in text.split("."))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _PreRelease) and self.parts == other.parts

    def __lt__(self, other: _PreRelease) -> bool:
        return self.parts < other.parts

    def __hash__(self) -> int:
        return hash(self.parts)


class Semver:
    """A semantic version as CEL's ``semver()`` returns it and as a ``version`` device attribute arrives."""

    __slots__ = ("build", "major", "minor", "patch", "pre", "text")

    def __init__(self, text: str) -> None:
        match = _SEMVER.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"{text!r} is not a semantic version (semver 2.0.0, e.g. '8.0.0')")
        self.text = text
        self.major, self.minor, self.patch = int(match[1]), int(match[2]), int(match[3])
        self.pre = match[4] or ""
        self.build = match[5] or ""

    @classmethod
    def parse(cls, text: str, normalize: bool = False) -> Semver:
        """With ``normalize``, Kubernetes' lenient form: a leading ``v`` dropped, missing minor and patch read as
        0, leading zeros dropped (``semver('v1.02', true)`` is 1.2.0)."""
        if normalize and isinstance(text, str):
            text = _normalize(text)
        return cls(text)

    def key(self) -> tuple[int, int, int, int, _PreRelease | None]:
        # A version without a pre-release ranks above the same version with one.
        return (self.major, self.minor, self.patch, 0 if self.pre else 1, _PreRelease(self.pre) if self.pre else None)

    def compare(self, other: Semver) -> int:
        a, b = self.key(), other.key()
        if a[:4] != b[:4]:
            return -1 if a[:4] < b[:4] else 1
        if a[4] is None or b[4] is None or a[4] == b[4]:
            return 0
        return -1 if a[4] < b[4] else 1

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Semver):
            return NotImplemented
        return self.compare(other) == 0

    def __hash__(self) -> int:
        return hash((self.major, self.minor, self.patch, self.pre))

    def __repr__(self) -> str:
        return f"semver({self.text!r})"

    def __str__(self) -> str:
        return self.text


def _normalize(text: str) -> str:
    stripped = text.strip().removeprefix("v")
    cut = min((i for i in (stripped.find("-"), stripped.find("+")) if i >= 0), default=len(stripped))
    core, rest = stripped[:cut], stripped[cut:]
    parts = core.split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return text  # left for the strict parser to reject
    parts = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(parts) + rest
