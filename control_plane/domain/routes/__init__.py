"""Routes: the routing table routers read (`GET /v1/routes`, with an ETag) and their demand reports
(`POST /v1/routes/demand`); the wire schemas are shared.routes."""
