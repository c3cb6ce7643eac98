"""A simulated container's file system (tests/clustersim.py): run in the container's own mount
namespace (`unshare --mount`) before its command, it builds a root of the container's own and
runs the command in it, so that no run of the simulation creates or shares a directory of the
host (two runs on one machine, or a checkout anywhere, do not get in each other's way).

- The root: the host's `/` under an overlay whose upper layer is a tmpfs of this container
  (a mount point such as /var/lib/cube or /donefile is made there, not on the host), with
  the host's other mounts (/proc, /sys, /dev, the network namespace's /etc/hosts, ...) bound
  at their places.
- The volumes: bound at their mountPaths from their host directories (read-only when asked).
- The code: the checkout and the venv the console scripts run from are bound again at their
  own paths when a volume hides them (a checkout under /tmp, where the pods mount a volume).
- Then the root is made read-only when the container asks for it, the process enters it
  (chroot), takes its user (setpriv, keeping its parent-death signal) and runs the command.

    python tests/sim_root.py SPEC_JSON -- COMMAND [ARGS...]

SPEC_JSON: {"root": private empty directory, "volumes": [[source, mountPath, read_only]...],
"expose": [host paths the command needs], "read_only_root": bool, "user": uid or null}.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

# Network namespace handles (`ip netns add`): not the container's business, and a bind of
# them would keep deleted namespaces alive.
_NOT_BOUND = ("/run/netns",)
_ESCAPE = re.compile(r"\\([0-7]{3})")


def _under(path: str, parent: str) -> bool:
    return PurePosixPath(path).is_relative_to(parent)


def top_mounts(mountinfo: str) -> list[str]:
    """The mount points of /proc/self/mountinfo that no other mount point but / contains: bound
    recursively, they bring every mount of the host but the root file system itself."""
    points = set()
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            points.add(_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4]))
    points.discard("/")
    return sorted(
        p
        for p in points
        if not any(q != p and _under(p, q) for q in points)
        and not any(_under(p, skip) for skip in _NOT_BOUND)
    )


def plan(
    spec: dict[str, Any], host_mounts: list[str], exists: Callable[[str], bool] = os.path.exists
) -> list[list[str]]:
    """The mount commands that build the container's root under spec["root"] (pure but for
    `exists`, asked of the host's paths)."""
    private = spec["root"]
    root = f"{private}/root"
    commands = [
        ["mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "cube-sim-root", private],
        ["mkdir", f"{private}/upper", f"{private}/work", root],
        ["mount", "-t", "overlay", "overlay", "-o",
         f"lowerdir=/,upperdir={private}/upper,workdir={private}/work", root],
    ]  # fmt: skip
    for mount in host_mounts:
        commands.append(["mount", "--rbind", mount, root + mount])
    volumes = sorted(spec["volumes"], key=lambda v: len(PurePosixPath(v[1]).parts))
    for source, mount_path, read_only in volumes:
        within = [m for m in host_mounts if _under(mount_path, m)]
        if within and not exists(mount_path):  # a mount point made there: made on the host
            raise ValueError(f"volume at {mount_path}: no such directory in {within[0]}")
        target = root + mount_path
        commands += [["mkdir", "-p", target], ["mount", "--bind", source, target]]
        if read_only:
            commands.append(["mount", "-o", "remount,bind,ro", target])
    hidden = [
        path
        for path in spec["expose"]
        if any(_under(path, mount_path) for _, mount_path, _ in volumes)
    ]
    for path in hidden:
        if any(other != path and _under(path, other) for other in hidden):
            continue  # inside another path bound again
        commands += [["mkdir", "-p", root + path], ["mount", "--bind", path, root + path]]
        if spec["read_only_root"]:
            commands.append(["mount", "-o", "remount,bind,ro", root + path])
    if spec["read_only_root"]:
        commands.append(["mount", "-o", "remount,bind,ro", root])
    return commands


def main(argv: list[str]) -> None:
    spec = json.loads(argv[1])
    command = argv[argv.index("--") + 1 :]
    with open("/proc/self/mountinfo") as mountinfo:
        host_mounts = top_mounts(mountinfo.read())
    tools = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin:/usr/bin:/bin"}
    for step in plan(spec, host_mounts):
        done = subprocess.run(step, capture_output=True, text=True, timeout=30, env=tools)
        if done.returncode:
            sys.exit(f"sim_root: {' '.join(step)}: {done.stderr.strip()}")
    os.chroot(f"{spec['root']}/root")
    os.chdir("/")
    if spec["user"] is not None:
        uid = str(spec["user"])
        command = ["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups",
                   "--pdeathsig", "keep", *command]  # fmt: skip
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv)
