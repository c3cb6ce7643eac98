"""The distribution: one top-level `cube` package (the repo's builder/, agent/, transfer/ and
bench/ install as cube.builder, cube.agent, cube.transfer, cube.bench), the pytest
microbenchmarks left out, py.typed shipped, and every console script importable from the
installed wheel alone (not through the editable install of the repo)."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Every test here starts processes (servers, CLIs): make quick skips them.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534  # another user, who owns neither the venv nor a writable home


def run(command: list[str], cwd: Path, timeout: float = 600) -> str:
    """Run a packaging command as a user types it (pip's defaults: isolated builds, the
    machine's pip configuration); its output, or a failure that shows it."""
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def runnable_by_everyone(path: Path) -> bool:
    """Every folder on the way searchable and the file executable by other users."""
    real = path.resolve()
    return all(p.stat().st_mode & 0o001 for p in [real, *real.parents])


def python_for_everyone() -> str:
    """An interpreter another user can run (this one may live under a 0700 home)."""
    for candidate in (sys.executable, "/usr/bin/python3.11"):
        if Path(candidate).exists() and runnable_by_everyone(Path(candidate)):
            return candidate
    pytest.skip("no Python 3.11 that other users can run")


def fresh_venv(where: Path, python: str = sys.executable) -> Path:
    """A new virtualenv with the newest pip; returns its bin/."""
    run([python, "-m", "venv", str(where)], cwd=where.parent, timeout=120)
    run([str(where / "bin" / "pip"), "install", "-q", "--upgrade", "pip"], cwd=where.parent)
    return where / "bin"


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """A folder other users may read (pytest's are 0700): the venv another user runs."""
    folder = Path(tempfile.mkdtemp(prefix="cube-packaging-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def tree(scratch: Path) -> Path:
    """The checkout's tracked files alone, as a fresh clone has them (no build/, no venv)."""
    target = scratch / "src"
    target.mkdir()
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = REPO / name.decode()
        if source.is_file():
            (target / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name.decode())
    return target


@pytest.fixture(scope="module")
def sdist(tree: Path, scratch: Path) -> Path:
    """`python -m build --sdist`, in a venv of its own with the newest pip and build."""
    tooling = fresh_venv(scratch / "tooling")
    run([str(tooling / "pip"), "install", "-q", "build"], cwd=scratch)
    out = scratch / "dist"
    run([str(tooling / "python"), "-m", "build", "--sdist", "--outdir", str(out), "."], cwd=tree)
    (found,) = out.glob("cube_py-*.tar.gz")
    return found


@pytest.fixture(scope="module")
def wheel(sdist: Path, scratch: Path) -> Path:
    """`pip wheel` of the sdist alone, from a folder with no checkout around it."""
    out = scratch / "wheel"
    out.mkdir()
    log = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(sdist)],
              cwd=out)  # fmt: skip
    (out / "build.log").write_text(log)
    (found,) = out.glob("cube_py-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(tree: Path, scratch: Path) -> Path:
    """`python3 -m venv v && v/bin/pip install -U pip && v/bin/pip install '.[server]'` in
    the tree, with a Python other users can run; returns the venv's bin/."""
    bin_dir = fresh_venv(scratch / "v", python_for_everyone())
    run([str(bin_dir / "pip"), "install", "-q", ".[server]"], cwd=tree)
    return bin_dir


def site_packages(bin_dir: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(run([str(bin_dir / "python"), "-c", code], cwd=bin_dir).strip())


def test_one_top_level_package(wheel: Path) -> None:
    """... and tagged for the interpreter and platform whose machine code it ships."""
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    abi = f"cp{sys.version_info.major}{sys.version_info.minor}"
    with open(REPO / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert wheel.name == f"cube_py-{version}-{abi}-{abi}-{platform}.whl"
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"cube"}
    for sub in ("builder", "agent", "transfer", "bench", "client", "server", "pb"):
        assert f"cube/{sub}/__init__.py" in names
    assert "cube/py.typed" in names
    assert {f"cube/transfer/page/status.{ext}" for ext in ("html", "js", "css")} <= set(names)
    assert not [n for n in names if "test_bench" in n or "/results/" in n]


def test_a_build_prints_no_setuptools_warning(wheel: Path, tmp_path: Path) -> None:
    """`pip install .` (the wheel) and `make install` (an editable build) print no setuptools
    warning: the status page's folder is a listed package, and the editable mode's notice,
    which asks nothing of the user, is filtered in setup.py."""
    assert "Warning" not in (wheel.parent / "build.log").read_text()
    code = "import sys; from setuptools import build_meta; build_meta.build_editable(sys.argv[1])"
    built = subprocess.run(
        [sys.executable, "-W", "default", "-c", code, str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert built.returncode == 0 and list(tmp_path.glob("*.whl")), built.stderr
    assert "Warning" not in built.stderr, built.stderr


def install(wheel: Path, target: Path) -> Path:
    """`pip install --target` of the wheel alone (no dependencies); returns `target`."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return target


def test_console_scripts_import_from_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    target = install(wheel, tmp_path / "site")
    entry_points = configparser.ConfigParser()
    (info,) = target.glob("cube_py-*.dist-info")
    entry_points.read(info / "entry_points.txt")
    modules = sorted({v.split(":")[0] for v in entry_points["console_scripts"].values()})
    assert all(m.startswith("cube.") for m in modules), modules
    launched = re.findall(r'"(cube\.[a-z_.]+)"\)', (REPO / "cube" / "entry.py").read_text())
    assert len(launched) == len(entry_points["console_scripts"])
    modules += launched
    # -S: no site processing, so the repo's editable finder is not installed; the venv's
    # site-packages come after the wheel's copy only for third-party packages.
    path = f"{target}:{sysconfig.get_paths()['purelib']}"
    code = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]];"
    code += " import cube; print(cube.__file__)"
    done = subprocess.run(
        [sys.executable, "-S", "-c", code, *modules],
        capture_output=True, text=True, timeout=120, env={"PYTHONPATH": path}, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(target))


def test_a_command_without_its_extra_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cube import entry

    installed = entry._requires()
    absent = 'no-such-package-here>=1; extra == "server"'
    monkeypatch.setattr(entry, "_requires", lambda: [*installed, absent])
    assert entry.cube_server() == 2
    err = capsys.readouterr().err
    assert "cube-server needs the cube-py[server] extra" in err
    assert "no-such-package-here not installed" in err and "pip install 'cube-py[server]'" in err


COMMAND_EXTRAS = ("server", "builder", "agent", "transfer", "bench")


def test_the_extras_are_read_from_the_package_metadata() -> None:
    """What a command's extra brings is pyproject.toml's list (the installed metadata), nested
    extras followed: no copy to fall out of date. The test install has every extra
    (cube-py[test] includes [all]): all present."""
    from cube import entry

    with open(REPO / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["project"]["optional-dependencies"]

    def names(extra: str) -> set[str]:
        found = set()
        for line in declared[extra]:
            name = re.match(r"[A-Za-z0-9._-]+", line).group(0)  # type: ignore[union-attr]
            if name == "cube-py":
                for inner in re.search(r"\[(.*)\]", line).group(1).split(","):  # type: ignore[union-attr]
                    found |= names(inner.strip())
            else:
                found.add(entry.canonical(name))
        return found

    for extra in COMMAND_EXTRAS:
        assert {entry.canonical(n) for n in entry.requirements(extra)} == names(extra), extra
    assert "numba" in entry.requirements("server")  # the old hand-kept list lacked it
    assert {extra: entry.missing(extra) for extra in COMMAND_EXTRAS} == {
        extra: [] for extra in COMMAND_EXTRAS
    }


def test_the_sdk_imports_without_the_extras(tmp_path: Path) -> None:
    """`pip install cube-py` (no extra) is enough for the SDK and the formats: they import no
    package of any extra (checked by making every extra's package unimportable); an Lz4Codec
    SequenceFile then says which extra to install."""
    from importlib import metadata

    from cube import entry

    wanted = {entry.canonical(n) for extra in COMMAND_EXTRAS for n in entry.requirements(extra)}
    provided = metadata.packages_distributions()
    blocked = sorted(
        name
        for name, dists in provided.items()
        if name.isidentifier() and any(entry.canonical(d) in wanted for d in dists)
    )
    assert {"uvloop", "numba", "lz4", "aiohttp"} <= set(blocked), blocked
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # import fails\n"
        "import cube.client, cube.routing, cube.shard, cube.wire, cube.seqfile, cube.codecs\n"
        "try:\n"
        "    cube.codecs.codec_by_name('lz4').decompress(b'\\0\\0\\0\\1\\0\\0\\0\\1x')\n"
        "except cube.codecs.CodecError as exc:\n"
        '    assert "cube-py[builder]" in str(exc), exc\n'
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_installed_kernel_is_complete_and_for_any_cpu_of_the_architecture(
    installed: Path,
) -> None:
    """`pip install .` ships every signature a server and the SDK run (`kernel_cache
    --check` loads them from a scratch copy and fails if one had to compile), compiled for
    a generic CPU: numba keys its cache by (target triple, CPU name, CPU features), so code
    for this host's features would miss on another CPU of the same architecture."""
    checked = run([str(installed / "python"), "-m", "cube.kernel_cache", "--check"], cwd=REPO)
    assert "loads with nothing to compile" in checked
    code = (
        "import pickle, sys, pathlib, numba\n"
        "seen = set()\n"
        "for index in pathlib.Path(sys.argv[1]).glob('*.nbi'):\n"
        "    with open(index, 'rb') as f:\n"
        "        pickle.load(f)  # numba's version\n"
        "        stamp, overloads = pickle.loads(f.read())\n"
        "    seen |= {key[1][1:] for key in overloads}  # (signature, magic, hashes)\n"
        "print(sorted(seen))\n"
    )
    cache = site_packages(installed) / "cube" / "_numba_cache"
    magic = run([str(installed / "python"), "-c", code, str(cache)], cwd=REPO).strip()
    assert magic == "[('generic', '')]", magic


def test_the_check_fails_on_an_install_missing_part_of_its_kernel(
    wheel: Path, tmp_path: Path
) -> None:
    target = install(wheel, tmp_path / "site")
    lane = sorted((target / "cube" / "_numba_cache").glob("_lane_jit.lane_pass-*"))
    assert lane
    for path in lane:
        path.unlink()
    done = subprocess.run(
        [sys.executable, "-S", "-m", "cube.kernel_cache", "--check"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={"PYTHONPATH": f"{target}:{sysconfig.get_paths()['purelib']}", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "missing 1 signatures" in done.stdout and "every server's first start" in done.stdout


def test_another_user_on_a_read_only_install_loads_the_shipped_kernel(
    installed: Path, scratch: Path
) -> None:
    """The installed cube-server run by a user who owns neither the venv (read-only to it)
    nor a writable home, with no NUMBA_CACHE_DIR: the shipped files are copied to a private
    folder in the temp dir and load there; nothing compiles, nothing lands in the venv."""
    from cube.processes import poll_until, stop_child

    cache = site_packages(installed) / "cube" / "_numba_cache"
    shipped = sorted(p.name for p in cache.iterdir())
    data = scratch / "nobody-data"
    data.mkdir(mode=0o777)
    data.chmod(0o777)
    temp = scratch / "nobody-tmp"
    temp.mkdir()
    temp.chmod(0o1777)
    log = scratch / "nobody-server.log"
    env = {"HOME": "/nonexistent", "PATH": f"{installed}:/usr/bin:/bin", "TMPDIR": str(temp)}
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [str(installed / "cube-server"), "--data_dir", str(data), "--port", "0",
             "--control_port", "0"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=data, user=NOBODY, group=NOBODY,
        )  # fmt: skip
    try:
        assert poll_until(lambda: "lookup kernel:" in log.read_text(), 120, 0.1), log.read_text()
    finally:
        stop_child(server, 20)
    text = log.read_text()
    assert "lookup kernel: compiled (numba" in text and "loaded from its cache" in text, text
    assert sorted(p.name for p in cache.iterdir()) == shipped
    private = temp / f"cube-kernel-{NOBODY}"
    assert private.stat().st_uid == NOBODY and private.stat().st_mode & 0o777 == 0o700
    assert {p.name for p in private.iterdir()} >= {n for n in shipped if n.endswith(".nbi")}


def test_a_temp_folder_another_user_made_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numba's cache files are pickles: a cube-kernel-<uid> folder that is not ours alone
    (made by someone else first, or open to others) is never used."""
    from cube import _jit

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = tmp_path / f"cube-kernel-{os.getuid()}"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    assert _jit._private_temp_folder() is None
    folder.chmod(0o700)
    assert _jit._private_temp_folder() == folder


def test_a_read_only_install_seeds_a_user_cache_with_the_shipped_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the package's folder is read-only (an image's site-packages), the kernel cache
    is a per-user folder seeded with the shipped files."""
    from cube import _jit

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "_kernel_jit._probe-30.py311.nbi").write_bytes(b"index")
    (shipped / "_kernel_jit._probe-30.py311.1.nbc").write_bytes(b"code")
    monkeypatch.setattr(_jit, "SHIPPED_CACHE", shipped)
    monkeypatch.delenv(_jit.CACHE_ENV, raising=False)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "user"))
    writable = _jit._writable
    monkeypatch.setattr(_jit, "_writable", lambda path: path != shipped and writable(path))
    folder = _jit.kernel_cache_dir()
    assert folder == tmp_path / "user" / "cube-kernel"
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in shipped.iterdir())
    assert (folder / "_kernel_jit._probe-30.py311.1.nbc").read_bytes() == b"code"
