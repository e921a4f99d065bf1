"""Kubernetes quantities and plain numbers as a user writes them, read within bounds (agent.core.quantity).

Ordinary quantities read as Kubernetes reads them (a reference implementation, exact arithmetic, agrees on every
one generated); anything else, however long or large, is either a quantity within the bound or a
``QuantityError`` naming the text and the bound, decided from the text before any arithmetic: ``1e10000000``
used to build a ten-million-digit number (seconds of CPU under the GIL) before failing.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agent.core.quantity import (
    MAX_DIGITS,
    MAX_INT64,
    NANO,
    QuantityError,
    parse_number,
    parse_quantity,
    quantity_value,
)

PROPERTY = settings(max_examples=300, deadline=None)
GI, TI = 1 << 30, 1 << 40
INT64_BOUND = "the most allowed here is 9223372036854775807 (2^63 - 1, the largest int64)"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1Gi", GI),
        ("512Mi", 512 << 20),
        ("1.5Gi", 3 << 29),
        ("2G", 2 * 10**9),
        ("1e9", 10**9),
        ("1E3", 1000),  # E with digits is an exponent ...
        ("2E", 2 * 10**18),  # ... E alone is exa
        ("1e+3", 1000),
        ("15e-1", Fraction(3, 2)),
        ("100m", Fraction(1, 10)),
        ("5u", Fraction(5, 10**6)),
        ("7n", Fraction(7, 10**9)),
        ("+.5Ki", 512),
        ("1.", 1),  # Kubernetes allows a trailing point
        ("007", 7),
        ("1048576", 1 << 20),
        ("-1Mi", -(1 << 20)),
        ("0", 0),
        ("-0.0e5", 0),
        (" 1Gi\n", GI),  # white space around, as Quantity's JSON decoding trims it
        ("9223372036854775807", MAX_INT64),  # the bound itself
        ("7Ei", 7 << 60),
        ("1e-12", Fraction(1, NANO)),  # Kubernetes rounds up (away from zero) to 1n
        ("-1e-12", Fraction(-1, NANO)),
        ("1.0000000001", Fraction(1_000_000_001, NANO)),
        ("1e-10000000", Fraction(1, NANO)),  # tiny: 1n, without computing 10^10000000
        ("-1e-100000000", Fraction(-1, NANO)),
        ("0e10000000", 0),
        (1 << 40, TI),  # a JSON integer
        (1.5e9, 1_500_000_000),  # a JSON float
    ],
)
@pytest.mark.timeout(5)  # as below: the tiny ones cost the unbounded parser seconds to minutes
def test_kubernetes_quantities(text: str | int | float, value: int | Fraction) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "it has no digits"),
        ("Gi", "it has no digits"),  # Kubernetes reads it as 0; nobody means that
        ("-", "it has no digits"),
        ("1 Gi", "white space inside"),
        ("1GB", "'B' at position 3"),
        ("0x10", "'x' at position 2"),
        ("1.2.3", "'.' at position 4"),
        ("1e", "unknown suffix 'e'"),
        ("1ki", "unknown suffix 'ki'"),
        ("1Mi3", "unknown suffix 'Mi3'"),
        ("1e99999999999999999999", "its exponent does not fit in 64 bits"),  # Go's ParseInt refuses it too
        ("\u0661", "it has no digits"),  # an Arabic-Indic one: Kubernetes' digits are ASCII
        (True, "True is not a quantity"),
        (float("inf"), "inf is not a quantity"),
        (float("nan"), "nan is not a quantity"),
    ],
)
def test_not_quantities_say_why_and_how_to_write_one(text: str, problem: str) -> None:
    with pytest.raises(QuantityError, match="is not a quantity") as refused:
        parse_quantity(text)
    assert problem in str(refused.value)
    assert "write e.g. 1Gi, 512Mi, 2G or 1073741824" in str(refused.value)
    assert not refused.value.out_of_range


@pytest.mark.timeout(5)  # unbounded, exact arithmetic spends seconds on 1e10000000, minutes on 1e100000000
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1e10000000", f"'1e10000000' is too large: {INT64_BOUND}"),
        ("1e100000000", f"'1e100000000' is too large: {INT64_BOUND}"),
        ("-1e10000000", "'-1e10000000' is too small: the least allowed here is -9223372036854775807"),
        ("8Ei", f"'8Ei' is too large: {INT64_BOUND}"),
        ("9223372036854775808", f"'9223372036854775808' is too large: {INT64_BOUND}"),
        ("0.00000000000000000001e39", f"is too large: {INT64_BOUND}"),  # 10^19 written small
        ("9" * 5000, f"'{'9' * 40}'... (5000 characters) is too large: {INT64_BOUND}"),
        ("1." + "0" * 200 + "1", "has 202 significant digits: a quantity may have at most 100"),
        pytest.param(10**5000, f"a number of about 5000 digits is too large: {INT64_BOUND}", id="int-10**5000"),
        (1e300, f"'1e+300' is too large: {INT64_BOUND}"),
    ],
)
def test_huge_quantities_are_refused_from_their_text_naming_the_bound(text: str | int, message: str) -> None:
    with pytest.raises(QuantityError) as refused:
        parse_quantity(text)
    assert message in str(refused.value)
    assert refused.value.out_of_range == ("significant digits" not in message)


def test_a_callers_limit_is_named_in_its_own_units() -> None:
    assert parse_quantity("16Ti", limit=16 * TI) == 16 * TI
    with pytest.raises(QuantityError, match=r"'17Ti' is too large: the most allowed here is 17592186044416 \(16Ti\)"):
        parse_quantity("17Ti", limit=16 * TI)
    with pytest.raises(QuantityError, match=r"'ten' is not a memory size: it has no digits; write 10Gi"):
        parse_quantity("ten", what="memory size", hint="write 10Gi")


@pytest.mark.parametrize(("text", "value"), [("1.5", 2), ("-1.5", -2), ("1n", 1), ("1Gi", GI), ("2", 2), ("-2", -2)])
def test_a_quantitys_value_rounds_up_away_from_zero_as_gos_value_does(text: str, value: int) -> None:
    assert quantity_value(text) == value


# ----- properties -------------------------------------------------------------------------------------------------

_REFERENCE = re.compile(
    r"(?P<sign>[+-]?)(?P<whole>[0-9]*)(?:\.(?P<fraction>[0-9]*))?"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?"
)
_FACTORS = {
    **{s: Fraction(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Fraction(10) ** e for s, e in {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15}.items()},
    "E": Fraction(10) ** 18,
}


def reference(text: str) -> Fraction:
    """Kubernetes' value of an ordinary quantity by plain exact arithmetic (fine for small exponents)."""
    match = _REFERENCE.fullmatch(text)
    assert match is not None
    fraction = match["fraction"] or ""
    value = Fraction(int(match["whole"] or "0")) + Fraction(int(fraction or "0"), 10 ** len(fraction))
    suffix = match["suffix"] or ""
    value *= _FACTORS[suffix] if suffix in _FACTORS else Fraction(10) ** int(suffix[1:]) if suffix else 1
    value = Fraction(math.ceil(value * NANO), NANO)  # inf.RoundUp to 1n (on the magnitude)
    return -value if match["sign"] == "-" else value


_SUFFIXES = st.sampled_from([*_FACTORS, ""]) | st.builds(
    lambda e, sign, exponent: f"{e}{sign}{abs(exponent) if sign else exponent}",
    st.sampled_from("eE"),
    st.sampled_from(["", "+", "-"]),
    st.integers(-25, 25),
)
ORDINARY = st.builds(
    lambda sign, whole, fraction, suffix: f"{sign}{whole}{'' if fraction is None else '.' + fraction}{suffix}",
    st.sampled_from(["", "+", "-"]),
    st.text("0123456789", max_size=14),
    st.none() | st.text("0123456789", max_size=14),
    _SUFFIXES,
).filter(lambda text: any(c.isdigit() for c in text.split("e")[0].split("E")[0]))


@PROPERTY
@given(ORDINARY)
@example("1.5Gi")
@example("999999999999999999e1")
def test_ordinary_quantities_agree_with_exact_arithmetic(text: str) -> None:
    expected = reference(text)
    if abs(expected) > MAX_INT64:
        with pytest.raises(QuantityError) as refused:
            parse_quantity(text)
        assert refused.value.out_of_range
    else:
        assert parse_quantity(text) == expected


QUANTITY_LIKE = st.text("0123456789.+-eEinumkKMGTP \t", max_size=300)
HUGE_EXPONENTS = st.builds(
    lambda mantissa, e, exponent: f"{mantissa}{e}{exponent}",
    st.sampled_from(["1", "0", "-7.5", ".000001", "123456789"]),
    st.sampled_from(["e", "E", "e+", "e-", "E-"]),
    st.integers(10**5, 10**40),
)


@pytest.mark.timeout(60)  # the examples below took the unbounded parser seconds to minutes each
@PROPERTY
@given(st.text(max_size=300) | QUANTITY_LIKE | HUGE_EXPONENTS | st.integers() | st.floats())
@example("1e10000000")
@example("1e100000000")
@example("-1E99999999")
@example("1" * 5000 + "e-4990")
@example("0." + "0" * 5000 + "1")
def test_any_input_is_a_bounded_quantity_or_a_quantity_error(text: str | int | float) -> None:
    try:
        value = parse_quantity(text)
    except QuantityError as error:
        assert len(str(error)) < 400  # the message shows a bounded excerpt of the text
        return
    assert abs(value) <= MAX_INT64
    assert (value * NANO).denominator == 1  # kept to 1n, as Kubernetes keeps it


@PROPERTY
@given(st.text(max_size=100) | st.floats().map(repr) | st.integers().map(str))
@example("inf")
@example("nan")
@example("1e400")
@example("-0")
def test_a_plain_number_is_finite_and_in_its_range_or_refused(text: str) -> None:
    try:
        value = parse_number(text, minimum=0, maximum=100)
    except QuantityError as error:
        assert "give one from 0 to 100" in str(error)
        return
    assert math.isfinite(value) and 0 <= value <= 100


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("inf", "'inf' is not a finite number"),
        ("nan", "'nan' is not a finite number"),
        ("1e400", "'1e400' is not a finite number"),
        ("-1", "'-1' is out of range"),
        ("101", "'101' is out of range"),
        ("ten", "'ten' is not a number"),
        ("1" * 100, "is not a number"),  # longer than any number a flag means
    ],
)
def test_plain_numbers_refused_say_the_range(text: str, problem: str) -> None:
    with pytest.raises(QuantityError, match="give one from 0 to 100") as refused:
        parse_number(text, minimum=0, maximum=100)
    assert problem in str(refused.value)


def test_max_digits_is_far_above_any_real_quantity() -> None:
    assert parse_quantity("0." + "1" * MAX_DIGITS) == Fraction(
        math.ceil(Fraction("0." + "1" * MAX_DIGITS) * NANO), NANO
    )
