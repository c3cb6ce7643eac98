"""Build the project's images with the container engine that is here (`make image`).

    python3 deploy/docker/images.py base  [--name cube-base:bookworm] [--force]
    python3 deploy/docker/images.py build [--target serving|builder-spark] [--tag T]
                                          [--base IMAGE]

`base` makes the Debian bookworm base the Dockerfile starts from, for machines that reach no
image registry: debootstrap (minbase, with python3, python3-venv, ca-certificates and passwd)
from the mirror this machine's apt uses, without apt's caches, docs, man pages and
translations, imported as an image. It is made once and kept in the engine's storage.
`build` runs the Dockerfile with that base (or --base python:3.11-slim-bookworm, say), on the
host's network, with this machine's pip configuration and the files it names (CA bundle,
constraints, local wheel folders) mounted read-only into the build: pip reaches its index only
through them on these machines.

Standard library only: it runs before any virtualenv exists.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
BASE_IMAGE = "cube-base:bookworm"
SUITE = "bookworm"
PACKAGES = "python3,python3-venv,ca-certificates,passwd"
# What a serving image never reads: apt's downloaded packages and lists (apt-get update
# fetches lists again where a later stage installs something), docs, man pages, messages.
TRIMMED = ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
           "usr/share/info", "usr/share/locale", "usr/share/lintian")  # fmt: skip
# dpkg leaves the same out of whatever a later stage installs
DPKG_EXCLUDES = """\
path-exclude=/usr/share/doc/*
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-exclude=/usr/share/lintian/*
"""


def project_version() -> str:
    with open(REPO / "pyproject.toml", "rb") as f:
        version: str = tomllib.load(f)["project"]["version"]
    return version


def engine() -> list[str]:
    """The engine's command with the options this host needs: $CUBE_ENGINE when set (a whole
    command, e.g. "docker" or "podman --runtime crun"); else podman, on runc where it is
    installed (crun fails on some cgroup v1 hosts) and with cgroupfs where systemd does not
    run; else docker."""
    chosen = os.environ.get("CUBE_ENGINE")
    if chosen:
        return chosen.split()
    if shutil.which("podman"):
        command = ["podman"]
        if shutil.which("runc"):
            command += ["--runtime", "runc"]
        if not Path("/run/systemd/system").is_dir():
            command += ["--cgroup-manager", "cgroupfs"]
        return command
    if shutil.which("docker"):
        return ["docker"]
    raise SystemExit("images.py: no container engine: install podman (make debs) or docker")


def is_podman(command: Sequence[str]) -> bool:
    return Path(command[0]).name == "podman"


def image_exists(command: Sequence[str], name: str) -> bool:
    done = subprocess.run(
        [*command, "image", "inspect", name], capture_output=True, timeout=60, check=False
    )
    return done.returncode == 0


def apt_mirror(suite: str = SUITE) -> str:
    """The Debian archive this machine's apt installs `suite` from (deb822 .sources files or
    sources.list), so the base comes from where the machine's packages come from."""
    apt = Path("/etc/apt")
    for path in sorted(apt.glob("sources.list.d/*.sources")):
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            fields = dict(re.findall(r"^([A-Za-z-]+):[ \t]*(.*)$", stanza, flags=re.MULTILINE))
            if (
                "deb" in fields.get("Types", "").split()
                and suite in fields.get("Suites", "").split()
            ):
                return fields["URIs"].split()[0]
    lists = [apt / "sources.list", *sorted(apt.glob("sources.list.d/*.list"))]
    for path in lists:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            words = re.sub(r"\[[^]]*\]", "", line).split()
            if len(words) >= 3 and words[0] == "deb" and words[2] == suite:
                return words[1]
    raise SystemExit(f"images.py: no apt source for {suite} in /etc/apt: pass --mirror URL")


@contextlib.contextmanager
def one_at_a_time() -> Iterator[None]:
    """One build on this machine at a time (test modules on parallel workers each ask for
    the image): the second waits, then finds the layers the first made."""
    with open(Path(tempfile.gettempdir()) / "cube-images.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def make_base(name: str, mirror: str | None, force: bool) -> None:
    with one_at_a_time():
        _make_base(name, mirror, force)


def _make_base(name: str, mirror: str | None, force: bool) -> None:
    command = engine()
    if image_exists(command, name) and not force:
        print(f"base image {name}: present")
        return
    if not shutil.which("debootstrap"):
        raise SystemExit("images.py: debootstrap is not installed (make debs installs it)")
    mirror = mirror or apt_mirror()
    with tempfile.TemporaryDirectory(prefix="cube-base-", dir="/var/tmp") as scratch:
        root = Path(scratch) / "root"
        subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={PACKAGES}", SUITE, str(root),
             mirror],
            check=True, timeout=1200, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        for path in TRIMMED:
            for entry in (root / path).glob("*"):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                elif entry.name != "lock":
                    entry.unlink()
        (root / "etc/dpkg/dpkg.cfg.d/cube-slim").write_text(DPKG_EXCLUDES)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        try:
            subprocess.run(
                [*command, "import", "--change", 'CMD ["/bin/bash"]', "-", name],
                stdin=tar.stdout, check=True, timeout=600, stdout=subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            if tar.stdout:
                tar.stdout.close()
            tar.wait(timeout=600)
    print(f"base image {name}: made from {SUITE} ({mirror})")


def pip_config() -> configparser.ConfigParser:
    """This machine's pip configuration, merged (files and PIP_* variables) as one file."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True, text=True, timeout=60, check=False,
    ).stdout  # fmt: skip
    merged = configparser.ConfigParser(interpolation=None)
    for line in listed.splitlines():
        match = re.match(r"^([^.]*)\.([^=]+)='(.*)'$", line)
        if not match:
            continue
        section, key, value = match.groups()
        section = "global" if section in ("", ":env:") else section
        if not merged.has_section(section):
            merged.add_section(section)
        merged.set(section, key, value)
    return merged


def referenced_paths(config: configparser.ConfigParser) -> Iterator[Path]:
    """The files and folders a pip configuration names that exist here (a CA bundle,
    constraints, wheel folders, file:// indexes)."""
    for section in config.sections():
        for value in config[section].values():
            for word in value.split():
                path = Path(word.removeprefix("file://"))
                if word.startswith("file://") and path.name == "simple":
                    path = path.parent  # a local index's pages link to files beside it
                if path.is_absolute() and path.exists():
                    yield path


def pip_mounts(scratch: Path) -> list[str]:
    config = pip_config()
    if not config.sections():
        return []
    conf = scratch / "pip.conf"
    with open(conf, "w") as f:
        config.write(f)
    mounts = ["-v", f"{conf}:/etc/pip.conf:ro"]
    for path in sorted(set(referenced_paths(config))):
        mounts += ["-v", f"{path}:{path}:ro"]
    return mounts


def build(target: str, tag: str | None, base: str, no_cache: bool = False) -> str:
    """Build `target` of the Dockerfile (every step again with `no_cache`; pip's download
    cache still serves); returns the image's name."""
    command = engine()
    version = project_version()
    name = tag or (f"cube-py:{version}" if target == "serving" else f"cube-py-{target}:{version}")
    if base == BASE_IMAGE and not image_exists(command, base):
        make_base(base, None, force=False)
    with one_at_a_time(), tempfile.TemporaryDirectory(prefix="cube-image-") as scratch:
        options = ["--network", "host", "--build-arg", f"BASE_IMAGE={base}",
                   "--build-arg", f"CUBE_VERSION={version}", "--target", target,
                   "-f", str(DOCKERFILE), "-t", name]  # fmt: skip
        if is_podman(command):
            options += ["--layers", *pip_mounts(Path(scratch))]
        if no_cache:
            options.append("--no-cache")
        subprocess.run([*command, "build", *options, str(REPO)], check=True, timeout=3600)
    print(f"image {name}: built ({target}, on {base})")
    return name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    base = commands.add_parser("base", help="make the Debian bookworm base image")
    base.add_argument("--name", default=BASE_IMAGE)
    base.add_argument("--mirror", help="Debian archive URL (default: this machine's apt source)")
    base.add_argument("--force", action="store_true", help="make it again though it exists")
    image = commands.add_parser("build", help="build an image of the Dockerfile")
    image.add_argument("--target", default="serving", choices=("serving", "builder-spark", "wheel"))
    image.add_argument("--tag", help="default: cube-py:<version> (cube-py-<target>:<version>)")
    image.add_argument("--base", default=BASE_IMAGE, help=f"base image (default: {BASE_IMAGE})")
    image.add_argument("--no-cache", action="store_true", help="build every step again")
    args = parser.parse_args(argv)
    if args.command == "base":
        make_base(args.name, args.mirror, args.force)
    else:
        build(args.target, args.tag, args.base, args.no_cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
