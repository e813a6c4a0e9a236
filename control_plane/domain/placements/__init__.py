"""Placements: which engine should hold which adapter version, telling the engines, and recording what they say.

- planner: desired state on `placements` rows, inside the caller's transaction, and one PushOrder per engine;
- replicas, rendezvous, rebalance, scaling: the rules, as pure functions (how many engines, which ones,
  what to move, when demand changes the count);
- view: the rows those rules decide on, read into their shapes;
- fleet: once per reconcile round, every adapter brought back to its rules (scaling, re-placement, release,
  bounded rebalancing), by one control-plane replica at a time;
- push: after the commit, the orders carried out against the engines at once;
- reconcile: on a timer and after a (re-)registration, the fleet pass, then every healthy engine brought to
  what its rows desire (residency and the engines' queues recorded on the way);
- answers: the one way an engine's answer lands on placement rows, shared by push and reconcile, and the
  one way a recorded version is loaded (with its digest, checked in the reply);
- demand: the queue figures per adapter that engines and routers report.
"""
