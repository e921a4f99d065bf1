"""What the API server said in a failed call (agent.kube_status): the Status's message, or nothing."""

from __future__ import annotations

import json

import pytest

from agent.kube_status import MAX_STATUS_BODY, status_message

STATUS = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": 'nodes "n1" is forbidden', "code": 403}


class Failed(Exception):
    def __init__(self, body: object) -> None:
        self.body = body
        self.reason = "Forbidden"


@pytest.mark.parametrize("body", [json.dumps(STATUS), json.dumps(STATUS).encode()])
def test_the_status_message_is_read_from_either_clients_body(body: object) -> None:
    assert status_message(Failed(body)) == 'nodes "n1" is forbidden'


@pytest.mark.parametrize(
    "body",
    [
        None,  # no answer came
        "",
        "<html>502 Bad Gateway</html>",  # a proxy's page, not a Status
        json.dumps(["a", "list"]),
        json.dumps({"kind": "Status", "message": ""}),
        "[" * 50_000,  # too deep for the parser: not a Status either
        json.dumps({**STATUS, "details": "x" * MAX_STATUS_BODY}),  # larger than any Status: not parsed
        42,
    ],
)
def test_a_body_that_is_not_a_status_has_no_message(body: object) -> None:
    assert status_message(Failed(body)) is None


def test_an_error_without_a_body_has_no_message() -> None:
    assert status_message(ValueError("no answer")) is None
