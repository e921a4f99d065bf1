"""Errors as the API server reports them: a ``metav1.Status`` body, and field errors in apimachinery's wording.

``FieldError.__str__`` follows ``k8s.io/apimachinery/pkg/util/validation/field.Error``: ``<field>: <type>: <value>:
<detail>``; an Invalid Status message is ``<Kind>.<group> "<name>" is invalid: <error>`` or ``[<e1>, <e2>]``.
"""

from __future__ import annotations

import json
from typing import Any

from msgspec import Struct

from agent.sim.apiserver.kinds import Kind

REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Expired",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}

_OMIT = object()


def status_body(code: int, message: str, reason: str | None = None, details: dict | None = None) -> dict:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason if reason is not None else REASONS.get(code, ""),
        "code": code,
    }
    if details:
        body["details"] = details
    return body


def success_status(kind: Kind, name: str, uid: str | None) -> dict:
    """What DELETE of one object answers when it is gone at once and its registry does not return the object."""
    details: dict[str, Any] = {"name": name, "group": kind.group, "kind": kind.plural}
    if uid:
        details["uid"] = uid
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}


class ApiError(Exception):
    """An error answer: HTTP ``code`` with a Status body."""

    def __init__(
        self,
        code: int,
        message: str,
        reason: str | None = None,
        details: dict | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason if reason is not None else REASONS.get(code, "")
        self.details = details
        self.headers = headers or {}

    def status(self) -> dict:
        return status_body(self.code, self.message, self.reason, self.details)


def _details(kind: Kind, name: str) -> dict:
    return {"name": name, "group": kind.group, "kind": kind.plural}


def not_found(kind: Kind, name: str) -> ApiError:
    return ApiError(404, f'{kind.qualified_resource} "{name}" not found', details=_details(kind, name))


def already_exists(kind: Kind, name: str) -> ApiError:
    return ApiError(
        409, f'{kind.qualified_resource} "{name}" already exists', "AlreadyExists", details=_details(kind, name)
    )


def conflict(kind: Kind, name: str, why: str | None = None) -> ApiError:
    why = why or "the object has been modified; please apply your changes to the latest version and try again"
    return ApiError(
        409,
        f'Operation cannot be fulfilled on {kind.qualified_resource} "{name}": {why}',
        "Conflict",
        details=_details(kind, name),
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, message, "BadRequest")


def gone(message: str) -> ApiError:
    return ApiError(410, message, "Expired")


# --------------------------------------------------------------------------------------------------
# Field errors (k8s.io/apimachinery/pkg/util/validation/field)
# --------------------------------------------------------------------------------------------------


def _go_value(value: object) -> str:
    if isinstance(value, str):
        return json.dumps(value)  # Go's %q for plain strings
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class FieldError(Struct):
    type: str  # "Invalid value", "Required value", ...
    reason: str  # the Status cause reason: FieldValueInvalid, ...
    field: str
    value: object = _OMIT
    detail: str = ""

    def body(self) -> str:
        if self.value is _OMIT or self.type in ("Required value", "Forbidden", "Too long"):
            text = self.type
        else:
            text = f"{self.type}: {_go_value(self.value)}"
        return f"{text}: {self.detail}" if self.detail else text

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"

    def cause(self) -> dict:
        return {"reason": self.reason, "message": self.body(), "field": self.field}


def invalid_value(field: str, value: object, detail: str) -> FieldError:
    return FieldError("Invalid value", "FieldValueInvalid", field, value, detail)


def required(field: str, detail: str = "") -> FieldError:
    return FieldError("Required value", "FieldValueRequired", field, _OMIT, detail)


def too_many(field: str, actual: int, limit: int) -> FieldError:
    return FieldError("Too many", "FieldValueTooMany", field, actual, f"must have at most {limit} items")


def too_long(field: str, limit: int) -> FieldError:
    return FieldError("Too long", "FieldValueTooLong", field, _OMIT, f"may not be more than {limit} bytes")


def duplicate(field: str, value: object) -> FieldError:
    return FieldError("Duplicate value", "FieldValueDuplicate", field, value)


def forbidden(field: str, detail: str) -> FieldError:
    return FieldError("Forbidden", "FieldValueForbidden", field, _OMIT, detail)


def not_supported(field: str, value: object, valid: list[str]) -> FieldError:
    listed = ", ".join(json.dumps(v) for v in sorted(valid))
    return FieldError("Unsupported value", "FieldValueNotSupported", field, value, f"supported values: {listed}")


def immutable(field: str, value: object) -> FieldError:
    return invalid_value(field, value, "field is immutable")


def invalid(kind: Kind, name: str, errors: list[FieldError]) -> ApiError:
    """422 Invalid, worded as ``errors.NewInvalid`` words it."""
    aggregate = str(errors[0]) if len(errors) == 1 else "[" + ", ".join(str(e) for e in errors) + "]"
    return ApiError(
        422,
        f'{kind.qualified_kind} "{name}" is invalid: {aggregate}',
        "Invalid",
        details={"name": name, "group": kind.group, "kind": kind.kind, "causes": [e.cause() for e in errors]},
    )
