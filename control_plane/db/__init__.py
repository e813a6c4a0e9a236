"""Database layer: ORM models (one per file in models/), engine setup and the Alembic runner."""
