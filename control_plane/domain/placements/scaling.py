"""Demand scaling: each adapter's target replica count follows its queue, with hysteresis.

Once per reconcile interval the fleet pass (control_plane.domain.placements.fleet, one replica at a time)
reads each adapter's fresh demand reports (engines' waiting + running, read by the reconciler; routers'
queues, sent with POST /v1/routes/demand; combined so that a routed request counts once:
demand.current_demand) and asks `decide`:

- load = (waiting + running) / current replicas (healthy engines holding it, at least 1);
- above `scale_up_load_per_replica` without a break for `scale_window_s` → target + 1, at most `max`
  and the healthy engines able to take it (`ceiling`);
- no request at all for `scale_down_idle_s` → target - 1, never below `min`;
- after a change, none for one window (cool-down), whatever the figures say.

`decide` is a pure function of the policy, the bookkeeping (`ScaleState`, kept in adapters.scale_state)
and the figures, with the time passed in: the tests drive it with a fake clock. A decision carries its
reason in words and the figures behind it; the pass records it as an audit event and as
`scale_state.last_decision`, which GET /v1/lora_adapters/{name} shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from control_plane.settings import ControlPlaneSettings


@dataclass(frozen=True)
class ScalePolicy:
    load_per_replica: float = 8.0
    window_s: float = 30.0
    idle_s: float = 300.0

    @classmethod
    def of(cls, settings: ControlPlaneSettings) -> ScalePolicy:
        return cls(settings.scale_up_load_per_replica, settings.scale_window_s, settings.scale_down_idle_s)


@dataclass(frozen=True)
class ScaleFigures:
    """What one pass knows about one adapter."""

    waiting: int
    running: int
    replicas: int  # healthy engines holding it now
    target: int  # the target in force (min when scaling chose none)
    min: int
    ceiling: int  # max, bounded by the healthy engines able to take it

    @property
    def load(self) -> float:
        return (self.waiting + self.running) / max(self.replicas, 1)


@dataclass
class ScaleState:
    """The bookkeeping between passes (epoch seconds): since when the load has been high, or the adapter
    idle, and when the target last changed."""

    high_since: float | None = None
    idle_since: float | None = None
    last_change_at: float | None = None
    last_decision: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other keys of scale_state, kept as they are

    @classmethod
    def load(cls, raw: dict[str, Any] | None) -> ScaleState:
        raw = dict(raw or {})
        return cls(raw.pop("high_since", None), raw.pop("idle_since", None), raw.pop("last_change_at", None),
                   raw.pop("last_decision", None), raw)

    def dump(self) -> dict[str, Any]:
        out = {"high_since": self.high_since, "idle_since": self.idle_since, "last_change_at": self.last_change_at,
               "last_decision": self.last_decision, **self.extra}
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class Decision:
    at: float
    source: int  # the target before
    target: int  # the target after
    reason: str
    figures: dict[str, float]

    def dump(self) -> dict[str, Any]:
        return {"at": self.at, "from": self.source, "to": self.target, "reason": self.reason,
                "figures": self.figures}


def decide(policy: ScalePolicy, state: ScaleState, figures: ScaleFigures, now: float) -> tuple[ScaleState, Decision | None]:
    """The bookkeeping after this pass, and the decision taken (None: the target stays)."""
    demand = figures.waiting + figures.running
    high = figures.load > policy.load_per_replica
    new = ScaleState(
        high_since=(state.high_since if state.high_since is not None else now) if high else None,
        # idleness matters only where there is a replica to give back
        idle_since=(state.idle_since if state.idle_since is not None else now)
        if demand == 0 and figures.target > figures.min else None,
        last_change_at=state.last_change_at, last_decision=state.last_decision, extra=state.extra)
    cooling = state.last_change_at is not None and now - state.last_change_at < policy.window_s
    if cooling:
        return new, None
    base = {"waiting": float(figures.waiting), "running": float(figures.running), "replicas": float(figures.replicas),
            "load_per_replica": round(figures.load, 3), "threshold": policy.load_per_replica}
    if new.high_since is not None and now - new.high_since >= policy.window_s and figures.target < figures.ceiling:
        lasted = now - new.high_since
        decision = Decision(now, figures.target, figures.target + 1,
                            f"waiting+running per replica was {figures.load:.1f}, above {policy.load_per_replica:g}, "
                            f"for {lasted:.0f}s (window {policy.window_s:g}s)",
                            {**base, "high_for_s": round(lasted, 3), "ceiling": float(figures.ceiling)})
    elif new.idle_since is not None and now - new.idle_since >= policy.idle_s:
        lasted = now - new.idle_since
        decision = Decision(now, figures.target, figures.target - 1,
                            f"no requests waiting or running for {lasted:.0f}s (idle after {policy.idle_s:g}s)",
                            {**base, "idle_for_s": round(lasted, 3), "min": float(figures.min)})
    else:
        return new, None
    new.last_change_at = now
    new.last_decision = decision.dump()
    return new, decision
