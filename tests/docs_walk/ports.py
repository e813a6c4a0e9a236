"""The walk's one deviation from the text: the stack listens on free ports, not on `make run`'s.

`make run`'s ports appear in the pages as `localhost:PORT` or `127.0.0.1:PORT` (the router 8000, the
control plane 8080, the first engine 8100); each is rewritten to the port the walk's stack has. The
CLI's default control plane (http://127.0.0.1:8080, when LORAPLANE_URL is unset) is the walk's through
LORAPLANE_URL in the session's environment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ADDRESS = re.compile(r"\b(localhost|127\.0\.0\.1):(8000|8080|8100)\b")


@dataclass(frozen=True)
class Ports:
    router: int
    control: int
    engine: int

    def substitute(self, text: str) -> str:
        """`text` with each of make run's addresses pointing at this stack instead."""
        ours = {"8000": self.router, "8080": self.control, "8100": self.engine}
        return _ADDRESS.sub(lambda m: f"{m.group(1)}:{ours[m.group(2)]}", text)

    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control}"
