"""Security headers: the one every answer carries, and those of the HTML pages.

Every answer, the lane's and Flask's alike, says ``nosniff``: a browser never
reads a JSON body, or a result's bytes, as a type of its own guessing. The two
pages (``/docs``, ``/ops``) also forbid framing and referrers and allow only
their own inline ``<style>`` and ``<script>``, by a nonce made for each answer;
``/ops`` may fetch its own JSON and nothing else.
"""

from __future__ import annotations

import secrets
from typing import Any

from flask import Response, render_template

#: Carried by every answer.
EVERY_ANSWER: dict[str, str] = {"X-Content-Type-Options": "nosniff"}


def page_headers(nonce: str) -> dict[str, str]:
    """An HTML page's headers, its inline style and script allowed by ``nonce``."""
    policy = "; ".join((
        "default-src 'none'", f"script-src 'nonce-{nonce}'", f"style-src 'nonce-{nonce}'", "connect-src 'self'",
        "img-src 'self'", "base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'",
    ))
    return {"Content-Security-Policy": policy, "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-store"}


def page(template: str, **context: Any) -> Response:
    """``template`` rendered with a fresh ``nonce``, under the pages' headers."""
    nonce = secrets.token_urlsafe(16)
    html = render_template(template, nonce=nonce, **context)
    return Response(html, 200, mimetype="text/html", headers=page_headers(nonce))
