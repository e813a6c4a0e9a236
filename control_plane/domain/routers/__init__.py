"""The routers that report to this control plane: recorded from their demand reports, listed by
GET /v1/routers and the console's Fleet page."""
