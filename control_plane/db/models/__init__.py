"""ORM models of the control plane, one per file; importing this package registers them all.

They share advanced-alchemy's metadata (`advanced_alchemy.base.orm_registry.metadata`), which
Alembic's env.py and the migration test compare against.
"""

from control_plane.db.models.adapter import Adapter
from control_plane.db.models.adapter_version import AdapterVersion
from control_plane.db.models.api_key import ApiKey
from control_plane.db.models.artifact_blob import ArtifactBlob
from control_plane.db.models.audit_event import AuditEvent
from control_plane.db.models.console_session_end import ConsoleSessionEnd
from control_plane.db.models.demand_report import DemandReport
from control_plane.db.models.engine import Engine, EngineState
from control_plane.db.models.placement import HOLDING, DesiredState, ObservedState, Placement
from control_plane.db.models.router import RouterInstance
from control_plane.db.models.stats_sample import StatsSample
from control_plane.db.models.tenant import Tenant
from control_plane.db.models.version_file import VersionFile

__all__ = [
    "HOLDING", "Adapter", "AdapterVersion", "ApiKey", "ArtifactBlob", "AuditEvent", "ConsoleSessionEnd", "DemandReport", "DesiredState",
    "Engine", "EngineState", "ObservedState", "Placement", "RouterInstance", "StatsSample", "Tenant", "VersionFile",
]
