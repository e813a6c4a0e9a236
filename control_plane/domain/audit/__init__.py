"""The audit trail read back: GET /v1/audit (rows written by control_plane.uow and control_plane.audit)."""
