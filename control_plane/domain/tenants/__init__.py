"""Tenants: teams, their API keys and quotas, and which adapters each may use (shared/tenants.py)."""
