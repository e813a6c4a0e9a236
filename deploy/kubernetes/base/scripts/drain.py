"""An engine pod's preStop hook: drain this engine at the control plane, then give routers time to see it.

POST {CONTROL_PLANE_URL}/v1/engines/{POD_NAME}/drain with the engine's own token (an engine may drain
itself): the control plane places nothing new here and the routing table drops the engine, which routers
read every second; after DRAIN_GRACE_S the kubelet sends SIGTERM, and the engine (which drains again,
harmlessly) lets the requests in flight finish. A failed call is reported and the hook still succeeds:
the shutdown must go on, and SIGTERM's own drain tries again. Standard library only (it runs in the
engine's image, wrapped by with-engine-token.sh for LORAPLANE_CONTROL_PLANE_TOKEN).
"""

from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request


def drain(control_plane_url: str, name: str, token: str, timeout_s: float = 10.0) -> int:
    """The HTTP status of the drain call (0: the control plane was not reached)."""
    url = f"{control_plane_url.rstrip('/')}/v1/engines/{urllib.parse.quote(name, safe='')}/drain"
    request = urllib.request.Request(url, method="POST", data=b"", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0


def main() -> int:
    env = os.environ
    status = drain(env["CONTROL_PLANE_URL"], env["POD_NAME"], env["LORAPLANE_CONTROL_PLANE_TOKEN"])
    print(f"drain of {env['POD_NAME']} at {env['CONTROL_PLANE_URL']}: {status or 'unreachable'}", file=sys.stderr)
    time.sleep(float(env.get("DRAIN_GRACE_S", "5")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
