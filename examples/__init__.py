"""Runnable examples around Cube (importable, so the tests can drive them)."""
