"""Inputs that break naive YAML loaders, shared by the tests that feed them to the agent."""

from __future__ import annotations

import itertools


def deep_nesting(depth: int = 500) -> bytes:
    """A ~1 kB config nested ``depth`` levels deep (PyYAML's constructor recurses once per level)."""
    return b"version: v1\nflags: " + b"[" * depth + b"]" * depth + b"\n"


def deep_mappings(depth: int = 400) -> bytes:
    return b"version: v1\nflags:\n" + b"".join(b" " * i + b"k%d:\n" % i for i in range(1, depth))


def billion_laughs(levels: int = 9) -> bytes:
    """Nine anchors, each a list of nine aliases to the one before: 9**9 strings once expanded."""
    names = "abcdefghij"[: levels + 1]
    lines = [b'a: &a ["x","x","x","x","x","x","x","x","x"]']
    for previous, current in itertools.pairwise(names):
        lines.append(f"{current}: &{current} [{','.join(['*' + previous] * 9)}]".encode())
    return b"\n".join(lines) + b"\n"


def binary_garbage(size: int = 2048) -> bytes:
    return bytes(range(256)) * (size // 256)
