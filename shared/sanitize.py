"""Text from another server made safe to show: printable, bounded, and URLs without their userinfo.

What an engine (or any server we call) answers is never passed on verbatim: it may not even be the server
we think, and its text ends up in logs, JSON answers and the database. `sanitize` keeps printable
characters only, whitespace runs collapsed, the userinfo of any URL in the text dropped, at most `limit` of
them; `safe_url` drops a URL's userinfo,
query and fragment (a password in a URL must not reach a log or a stored error); `reply_reason` is an
error answer as status plus the server's OpenAI-style message so treated, never the body itself.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

import httpx
import msgspec

MAX_REASON = 200
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/?#@]*@")  # scheme://user:password@


def sanitize(text: str, limit: int = MAX_REASON) -> str:
    """Printable characters only, URLs without their userinfo, at most `limit` of them: safe in logs, JSON
    answers and the database."""
    clean = "".join(c if c.isprintable() else " " for c in text[: limit * 2])
    clean = _URL_USERINFO.sub(r"\1", " ".join(clean.split()))
    return clean if len(clean) <= limit else clean[: limit - 1] + "…"


def safe_url(url: str) -> str:
    """`url` without userinfo (a password in a URL must not reach logs or `last_error`)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return "<invalid url>"
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = host + (f":{port}" if port is not None else "")
    return sanitize(urlunsplit((parts.scheme, netloc, parts.path, "", "")), 300)


def reply_reason(status: int, raw: bytes) -> str:
    """Status plus a short reason: the server's OpenAI-style error message, bounded and sanitized, or the
    standard phrase of the status. Never the body itself."""
    phrase = httpx.codes.get_reason_phrase(status) or "error"
    if 300 <= status < 400:
        return f"{status} {phrase} (redirects are not followed)"
    try:
        message = msgspec.json.decode(raw, type=_ErrorBody).error.message
    except (msgspec.ValidationError, msgspec.DecodeError):
        return f"{status} {phrase}"
    return f"{status} {sanitize(message)}" if message else f"{status} {phrase}"


class _ErrorDetail(msgspec.Struct):
    message: str = ""


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail
