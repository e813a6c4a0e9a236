"""Engines: registration, heartbeats and health of the data-plane engines the control plane drives."""
