"""The build step pyproject.toml cannot declare: a wheel ships the lookup kernel's machine code.

After the sources are copied into the build tree, `python -m cube.kernel_cache` compiles the
kernel there, into `cube/_numba_cache` (cube/_jit.py: for a generic CPU of the build machine's
architecture, stamped by source content), so that an installed wheel's server loads it
instead of compiling at its first start. A build that cannot compile it fails: no wheel
without its kernel. Editable installs skip it (`make install` warms the kernel in the
checkout instead).

The wheel is tagged for the interpreter and platform that compiled it (cp311-cp311-
linux_x86_64, say), since that machine code is what it ships; anywhere else pip builds one
from the sdist.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py


class BuildPyWithKernel(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode or self.dry_run:
            return
        build_lib = Path(self.build_lib).resolve()
        cache = build_lib / "cube" / "_numba_cache"
        # The build tree first, then whatever the frontend put on the path: pip's isolated
        # build installs numpy and numba in a folder that only its PYTHONPATH entry (a
        # sitecustomize) adds, so replacing PYTHONPATH would hide them from the child.
        inherited = os.environ.get("PYTHONPATH", "")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(build_lib), inherited])),
            "CUBE_KERNEL_CACHE": str(cache),
            "NUMBA_CPU_NAME": "generic",
        }
        env.pop("CUBE_KERNEL", None)  # a numpy-only environment would build nothing
        subprocess.run(
            [sys.executable, "-m", "cube.kernel_cache", "--require"],
            check=True, env=env, cwd=build_lib, timeout=900,
        )  # fmt: skip
        if not list(cache.glob("*.nbc")):
            raise SystemExit(f"setup.py: no compiled kernel in {cache}: refusing to build a wheel")


class MachineCodeDistribution(Distribution):
    """Not a pure distribution: its wheel holds machine code for this interpreter and
    architecture, so it is built into the platform's folder and tagged for it."""

    def has_ext_modules(self) -> bool:
        return True


# An editable install (make install) maps cube.builder, cube.agent, ... to the repo's folders
# with a meta path finder, and setuptools says so on every such install with a warning
# ("Editable installation": beware of folders named like the package in the working
# directory). Nothing to act on: the one top-level name is `cube`, the folder it maps to.
warnings.filterwarnings("ignore", message="Editable installation")

setup(cmdclass={"build_py": BuildPyWithKernel}, distclass=MachineCodeDistribution)
