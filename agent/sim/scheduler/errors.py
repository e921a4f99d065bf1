"""What the simulated scheduler raises; importable without loading the CEL library."""

from __future__ import annotations


class Unschedulable(Exception):
    """The claim cannot be allocated on this node; ``reason`` says which request and why, in the scheduler's
    words where it has them ("cannot allocate all claims", "CEL runtime error", ...)."""

    def __init__(self, reason: str, *, cel_error: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.cel_error = cel_error


class CELCompileError(ValueError):
    """The expression cannot be compiled: a syntax error, an unknown name, an unsupported feature."""

    def __init__(self, expression: str, detail: str) -> None:
        super().__init__(f"CEL compile error in selector {expression!r}: {detail}")
        self.expression = expression
        self.detail = detail


class CELRuntimeError(Exception):
    """Evaluating the expression for one device failed ("no such key: profile"); Kubernetes' text in ``detail``."""

    def __init__(self, expression: str, detail: str) -> None:
        super().__init__(detail)
        self.expression = expression
        self.detail = detail
