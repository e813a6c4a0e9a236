"""Domains of the control plane's admin API, each with schemas, a service (the rules) and a controller."""
