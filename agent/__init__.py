"""cube-agent: deploys shard versions onto one cube-server instance (see docs/ROLLOUT.md)."""

__version__ = "0.1.0"
