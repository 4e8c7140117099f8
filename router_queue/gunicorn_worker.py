"""The front door's gunicorn worker: gevent's, with gunicorn's own refusals
of bad input answered in the contract's shape.

gunicorn refuses a request it cannot parse (a malformed request line or
header, a bad chunk, a request line or header field past
``--limit-request-line`` / ``--limit-request-field_size``) itself, before the
app runs, with an HTML page. Clients of this API tell errors apart by
``X-Comfy-Error-Type``, so this worker answers those refusals as the app
answers bad input: ``invalid_input``, a JSON body, ``X-Comfy-Request-Id``,
under the status gunicorn chose. Refusals that are not about the client's
input (the app's own bad response header, proxy and TLS trouble, unsupported
features) stay gunicorn's.

Run it with ``gunicorn --worker-class router_queue.gunicorn_worker.GeventWorker``
(the Procfile does). gunicorn imports it in the master, before gevent patches
anything, so it imports only the standard library, gunicorn and ``errors``.
"""

from __future__ import annotations

import json
import uuid
from http import HTTPStatus

from gunicorn import util
from gunicorn.http import errors as http_errors
from gunicorn.workers import ggevent

from .errors import InvalidInput

#: gunicorn's refusals that are not the client's malformed input (by name:
#: older gunicorn releases lack some of them).
_NOT_BAD_INPUT = tuple(getattr(http_errors, name) for name in (
    "ConfigurationProblem", "ForbiddenProxyRequest", "ExpectationFailed", "UnsupportedTransferCoding",
    "InvalidResponseHeader", "InvalidResponseHeaderName", "InvalidH2CPreface",
) if hasattr(http_errors, name))
#: Statuses gunicorn gives bad input other than 400.
_STATUS = ((http_errors.LimitRequestLine, HTTPStatus.REQUEST_URI_TOO_LONG),
           (http_errors.LimitRequestHeaders, HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE))
#: Longest part of gunicorn's own message kept in ``detail`` (it may quote the input).
_DETAIL_CHARS = 200


def refusal(exc: Exception) -> bytes | None:
    """The whole HTTP answer to ``exc``, or None when gunicorn should answer it."""
    if not isinstance(exc, http_errors.ParseException) or isinstance(exc, _NOT_BAD_INPUT):
        return None
    status = next((code for kind, code in _STATUS if isinstance(exc, kind)), HTTPStatus.BAD_REQUEST)
    error = InvalidInput(f"the server could not read this request ({status.phrase}): {str(exc)[:_DETAIL_CHARS]}")
    body = json.dumps(error.body(), separators=(",", ":")).encode()
    head = [f"HTTP/1.1 {status.value} {status.phrase}", "Connection: close", "Content-Type: application/json",
            f"Content-Length: {len(body)}", *(f"{name}: {value}" for name, value in error.headers().items()),
            f"X-Comfy-Request-Id: {uuid.uuid4()}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class GeventWorker(ggevent.GeventWorker):
    def handle_error(self, req, client, addr, exc):
        answer = refusal(exc)
        if answer is None:
            return super().handle_error(req, client, addr, exc)
        self.log.warning("Invalid request from ip=%s: %s", (addr or ("",))[0], exc)
        try:
            util.write_nonblock(client, answer)
        except Exception:  # the client may be gone already; as gunicorn does
            self.log.debug("Failed to send error message.")
