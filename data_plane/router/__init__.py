"""The router: one OpenAI endpoint in front of the engines, routing each request by its `model`.

Layers (pyproject.toml's contracts): cli → app → placement, proxy, demand → table, balancer → config,
request, metrics, errors → shared. No torch, nothing of the engine, nothing of the control plane: the
router ships in the base install and speaks to both halves only over HTTP (shared/routes.py).
"""
