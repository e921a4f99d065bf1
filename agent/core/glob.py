"""NVIDIA's anchored glob, as its device plugin matches resource names and GPU products: a module of its own so
that the config checker matches a config's ``match`` without loading the planner."""

from __future__ import annotations

import re
from fnmatch import translate


def glob_matches(pattern: str, subject: str) -> bool:
    """NVIDIA's anchored glob: only ``*`` is special and the pattern must match the whole string."""
    regex = translate(pattern.replace("[", "[[]").replace("?", "[?]"))
    return re.fullmatch(regex, subject) is not None
