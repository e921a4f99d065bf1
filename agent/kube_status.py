"""The API server's own words in a failed call: the ``message`` of the Status it answered with.

A failed call raises the lean client's :class:`agent.kube_http.KubeApiError` or the official client's
``ApiException``; both carry the answer's ``body`` (a Status, usually: a few hundred bytes of JSON) and its HTTP
``reason``. Every caller that tells what the API server said reads it here, one way.
"""

from __future__ import annotations

import json

MAX_STATUS_BODY = 64 << 10  # a body larger than this is not a Status: it is not parsed for a message


def status_message(error: BaseException) -> str | None:
    """The Status's ``message`` in ``error``'s body; None when there is no body, it is too large or not a Status."""
    body = getattr(error, "body", None)
    if not isinstance(body, bytes | str) or not body or len(body) > MAX_STATUS_BODY:
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if isinstance(parsed, dict) and parsed.get("message"):
        return str(parsed["message"])
    return None
