"""The HTTP calls of the admin CLI and what their answers mean as exit codes.

0: done; 1: partial (207: some engines failed, the change is recorded and the reconciler retries them);
2: error (any other non-2xx, the server's message on stderr; 502 of a push: every engine failed; the
control plane unreachable). Usage errors are click's own 2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from control_plane.admin_cli.config import Target

OK, PARTIAL, ERROR = 0, 1, 2


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any  # the decoded JSON answer (None when there was none)

    @property
    def exit_code(self) -> int:
        if self.status == 207:
            return PARTIAL
        return OK if 200 <= self.status < 300 else ERROR

    @property
    def pushed(self) -> bool:
        """An answer with each engine's outcome (a push: load, unload, activate, PATCH), errors included."""
        return isinstance(self.body, dict) and isinstance(self.body.get("engines"), list) and "error" not in self.body

    def warnings(self) -> list[str]:
        """What a change answered it does not do yet (a tenancy change no router enforces)."""
        found = self.body.get("warnings") if isinstance(self.body, dict) else None
        return [str(w) for w in found] if isinstance(found, list) else []

    def problem(self) -> str | None:
        """In words, why this is not exit code 0: the server's message, or what the engines did."""
        if self.exit_code == OK:
            return None
        if self.pushed:
            failed = [e for e in self.body["engines"] if e.get("outcome") == "failed"]
            which = "every engine" if self.status == 502 else f"{len(failed)} of {len(self.body['engines'])} engines"
            return (f"{self.status}: {which} failed ({', '.join(e['engine'] for e in failed)}); the change is "
                    "recorded and the reconciler retries them")
        error = self.body.get("error") if isinstance(self.body, dict) else None
        if isinstance(error, dict) and error.get("message"):
            return f"{self.status} {error.get('type') or 'error'}: {error['message']}"
        return f"{self.status}: {str(self.body)[:500] if self.body is not None else 'no body'}"


class Unreachable(Exception):
    """The control plane did not answer (connection refused, timeout, TLS): exit code 2."""


def adapter_path(name: str, *rest: str) -> str:
    """/v1/lora_adapters/{name}[/…]: names may hold `/`, which stays a path separator."""
    return "/".join([f"/v1/lora_adapters/{quote(name, safe='/')}", *rest])


class Api:
    def __init__(self, target: Target) -> None:
        self.target = target
        headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
        self._http = httpx.Client(base_url=target.url, headers=headers, timeout=target.timeout_s)

    def call(self, method: str, path: str, **kwargs: Any) -> Reply:
        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise Unreachable(f"cannot reach the control plane at {self.target.url}: "
                              f"{type(exc).__name__}: {exc}") from None
        try:
            body = r.json() if r.content else None
        except json.JSONDecodeError:
            body = r.text
        return Reply(r.status_code, body)

    def get(self, path: str, params: Any = None) -> Reply:
        return self.call("GET", path, params=params)

    def close(self) -> None:
        self._http.close()
