"""cube-agent: deploys shard versions onto one cube-server instance (see docs/ROLLOUT.md)."""

from cube.flags import package_version

__version__ = package_version()  # the installed cube-py's
