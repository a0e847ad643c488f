"""Alembic revisions, one file each (a package so that wheels ship them)."""
