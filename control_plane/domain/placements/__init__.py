"""Placements: which engine should hold which adapter version, telling the engines, and recording what they say.

- planner: desired state on `placements` rows, inside the caller's transaction, and one PushOrder per engine;
- push: after the commit, the orders carried out against the engines at once;
- reconcile: on a timer and after a (re-)registration, every healthy engine brought to what its rows desire;
- answers: the one way an engine's answer lands on placement rows, shared by push and reconcile, and the
  one way a recorded version is loaded (with its digest, checked in the reply).
"""
