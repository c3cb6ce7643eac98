"""The distribution: one top-level `cube` package (the repo's builder/, agent/, transfer/ and
bench/ install as cube.builder, cube.agent, cube.transfer, cube.bench), the pytest
microbenchmarks left out, py.typed shipped, and every console script importable from the
installed wheel alone (not through the editable install of the repo)."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

# Every test here starts processes (servers, CLIs): make quick skips them.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    leftover = not (REPO / "build").exists()  # setuptools builds in REPO/build: tidy it
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(REPO)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (out / "build.log").write_text(built.stdout + built.stderr)
    if leftover:
        shutil.rmtree(REPO / "build", ignore_errors=True)
    (found,) = out.glob("cube_py-*.whl")
    return found


def test_one_top_level_package(wheel: Path) -> None:
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


def test_a_server_from_the_wheel_loads_the_shipped_kernel(wheel: Path, tmp_path: Path) -> None:
    """The wheel ships the lookup kernel compiled (setup.py): a server installed from it, on a
    machine with no kernel cache of its own, loads it and compiles nothing at its first start
    (a compile there would hold the replica not ready for seconds)."""
    from cube.processes import poll_until, stop_child

    target = install(wheel, tmp_path / "site")
    shipped = sorted(p.name for p in (target / "cube" / "_numba_cache").glob("*.nbc"))
    assert any(name.startswith("_kernel_jit._seek_fixed") for name in shipped)
    env = {
        "PYTHONPATH": f"{target}:{sysconfig.get_paths()['purelib']}",
        "HOME": str(tmp_path / "home"),  # no user cache
        "PATH": "/usr/bin:/bin",
    }
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-S", "-m", "cube.server.main", "--data_dir", str(tmp_path / "d"),
             "--port", "0", "--control_port", "0"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
        )  # fmt: skip
    try:
        assert poll_until(lambda: "lookup kernel:" in log.read_text(), 120, 0.1), log.read_text()
    finally:
        stop_child(server, 20)
    text = log.read_text()
    assert "lookup kernel: compiled (numba" in text and "loaded from its cache" in text, text
    assert sorted(p.name for p in (target / "cube" / "_numba_cache").glob("*.nbc")) == shipped


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
