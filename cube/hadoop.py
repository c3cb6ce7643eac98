"""`hdfs://` and `afs://` through the Hadoop client command, configured as PaddlePaddle's
HDFSClient is: a Hadoop home (its `bin/hadoop fs`) and a dict of client settings, usually
`fs.default.name` (the cluster) and `hadoop.job.ugi` (`user,password`).

Where the settings come from (`settings`, read at each filesystem's creation):

- `CUBE_HADOOP_CMD`: the client command line, split as a shell would (e.g.
  `java -cp '/opt/jars/*' org.apache.hadoop.fs.FsShell`); else `$HADOOP_HOME/bin/hadoop fs`;
- `CUBE_HADOOP_CONFIGS`: `key=value` pairs separated by commas (a piece without `key=`
  continues the value before it, so `hadoop.job.ugi=user,password` is one pair), or a JSON
  object for values that rule cannot carry. cube-transfer's `-hadoop_home` and
  `-hadoop_configs` set both variables (`configure`), for the builds it runs too.

The settings reach the client as a `-conf` file of mode 0600 written for each run and removed
after it, never as `-D` arguments: the password in `hadoop.job.ugi` stays out of the process
list, and out of every message and log line (no message here quotes a setting, an argument or
what the client printed, besides the class names of the Java exceptions it reported).

Every run is bounded in wall time (its process group, started here, is stopped by its PID at
the deadline: SIGTERM, then SIGKILL), retried within that time when another try may help
(`cube.backoff.retrying`), and reads at most a given number of bytes of what the client
prints. Listings are `-ls` output parsed by the columns (`parse_listing`), paths with spaces
included, anything else the client prints on stdout (warnings, "Found N items") skipped, and a
line that looks like an entry but cannot be read is an error rather than a file left out.

`HadoopFileSystem` answers the fsspec calls cube/remote.py makes (`info`, `find`, `ls`,
`put_file`) plus streamed and bounded reads (`stream`, `read_limited`) and batched copies
(`get_files`), each with a `timeout`; it is no fsspec class (nothing to install, no instance
cache). A shell helper (process I/O), used through cube/remote.py only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from cube.backoff import Backoff, retrying
from cube.flags import flag

SCHEMES = ("hdfs", "afs")
ENV_HOME = "HADOOP_HOME"
ENV_CONFIGS = "CUBE_HADOOP_CONFIGS"
ENV_COMMAND = "CUBE_HADOOP_CMD"
ATTEMPTS = 3  # tries of one command, within its deadline
BACKOFF = Backoff(1.0, 8.0)
STDERR_KEEP = 64 << 10  # bytes of the client's stderr kept to classify a failure
LIST_LIMIT = 512 << 20  # bytes of -ls output read
STOP_GRACE = 2.0  # seconds between SIGTERM and SIGKILL of a client past its deadline
BATCH_ARGS = 64 << 10  # characters of paths in one -get command line
SETUP_HINT = (
    f"set {ENV_HOME} (cube-builder, cube-transfer: -hadoop_home) to the Hadoop client's home, or "
    f"{ENV_COMMAND} to its command line"
)


class HadoopError(Exception):
    """A command of the Hadoop client that failed, in words of our own (short, no setting,
    no argument, nothing the client printed but Java exception class names). `missing`: the
    path does not exist; `retryable`: another try may help; `denied`: permissions."""

    def __init__(
        self, message: str, *, missing: bool = False, retryable: bool = False, denied: bool = False
    ) -> None:
        super().__init__(message)
        self.missing = missing
        self.retryable = retryable
        self.denied = denied


# ---------------------------------------------------------------------------------------------
# settings

_KEY = re.compile(r"\s*([A-Za-z_][\w-]*(?:\.[\w-]+)+)\s*=(.*)", re.S)


def parse_configs(text: str) -> dict[str, str]:
    """The client settings `text` gives: `k=v,k=v` (a piece without `key=` continues the value
    before it: `hadoop.job.ugi=user,password`), or a JSON object. ValueError says what is
    wrong without quoting any of it (it holds a password)."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            found = json.loads(text)
        except ValueError:
            raise ValueError("not valid JSON") from None
        if not isinstance(found, dict) or not all(isinstance(k, str) for k in found):
            raise ValueError("not a JSON object of settings")
        return {k: v if isinstance(v, str) else json.dumps(v) for k, v in found.items()}
    configs: dict[str, str] = {}
    last = ""
    for number, piece in enumerate(text.split(","), 1):
        match = _KEY.fullmatch(piece)
        if match:
            last = match.group(1)
            configs[last] = match.group(2).strip()
        elif last:
            configs[last] += "," + piece
        else:
            raise ValueError(f"piece {number} is not key=value (keys are property names: a.b)")
    return configs


@dataclass(frozen=True)
class Settings:
    """The client command (without the subcommand) and its settings."""

    command: tuple[str, ...]
    configs: tuple[tuple[str, str], ...] = ()

    def __repr__(self) -> str:  # never the settings' values (a password)
        return f"Settings(command={self.command!r}, configs={[k for k, _ in self.configs]!r})"


def settings(environ: Mapping[str, str] | None = None) -> Settings:
    """The client `environ` (default: os.environ) configures; HadoopError when none is, when
    its command is not there, or when its settings cannot be read."""
    env = os.environ if environ is None else environ
    line = env.get(ENV_COMMAND, "").strip()
    if line:
        try:
            command = tuple(shlex.split(line))
        except ValueError:
            raise HadoopError(f"{ENV_COMMAND} is not a command line (unbalanced quotes)") from None
    else:
        home = env.get(ENV_HOME, "").strip()
        if not home:
            raise HadoopError(f"no Hadoop client configured: {SETUP_HINT}")
        command = (os.path.join(home, "bin", "hadoop"), "fs")
    if not command or shutil.which(command[0]) is None:
        where = command[0] if command else "(empty)"
        raise HadoopError(f"the Hadoop client command {where} is not there or not executable")
    try:
        configs = parse_configs(env.get(ENV_CONFIGS, ""))
    except ValueError as exc:
        raise HadoopError(f"{ENV_CONFIGS}: {exc}") from None
    return Settings(command, tuple(configs.items()))


def home_flag() -> str:
    """The -hadoop_home flag of the commands that read hdfs:// and afs:// addresses."""
    return flag(
        "",
        "the Hadoop client's home for hdfs:// and afs:// addresses ($HADOOP_HOME/bin/hadoop "
        "fs); sets HADOOP_HOME for the processes this one runs too",
        metavar="DIR",
    )


def configs_flag() -> str:
    """The -hadoop_configs flag, beside `home_flag`."""
    return flag(
        "",
        "the Hadoop client's settings, key=value,... (the cluster's name node URI, "
        "hadoop.job.ugi: docs/paddle.md): sets "
        "CUBE_HADOOP_CONFIGS for the processes this one runs too; a password belongs in a "
        "--flagfile or the environment, not the command line",
        metavar="K=V,...",
    )


def configure(home: str, configs: str) -> None:
    """Apply -hadoop_home and -hadoop_configs (when given) to this process's environment,
    which the processes it runs (cube-transfer's builds) inherit. ValueError for settings that
    cannot be read (the message quotes none of them)."""
    if configs:
        parse_configs(configs)
        os.environ[ENV_CONFIGS] = configs
    if home:
        os.environ[ENV_HOME] = home


def _conf_file(configs: Sequence[tuple[str, str]]) -> str | None:
    """A Hadoop configuration file holding `configs`, readable by this user only."""
    if not configs:
        return None
    handle, name = tempfile.mkstemp(prefix="cube-hadoop-", suffix=".xml")  # mode 0600
    body = "".join(
        f"<property><name>{escape(k)}</name><value>{escape(v)}</value></property>\n"
        for k, v in configs
    )
    with os.fdopen(handle, "w", encoding="utf-8") as out:
        out.write(f'<?xml version="1.0"?>\n<configuration>\n{body}</configuration>\n')
    return name


# ---------------------------------------------------------------------------------------------
# one run of the client


class _Expired(Exception):
    pass


class _Run:
    """One client process in a process group of its own: stdout read in bounded pieces,
    stderr drained meanwhile (its head kept), the group stopped by `close` if still there."""

    def __init__(self, config: Settings, args: Sequence[str]) -> None:
        self.conf = _conf_file(config.configs)
        generic = ["-conf", self.conf] if self.conf else []
        try:
            self.proc = subprocess.Popen(
                [*config.command, *generic, *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own group: the JVM and any wrapper stopped together
            )
        except OSError as exc:
            self._remove_conf()
            raise HadoopError(
                f"the Hadoop client command {config.command[0]} could not be started "
                f"({exc.strerror or type(exc).__name__})"
            ) from None
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.out = self.proc.stdout.fileno()
        self.err = self.proc.stderr.fileno()
        os.set_blocking(self.out, False)
        os.set_blocking(self.err, False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.out, selectors.EVENT_READ)
        self.selector.register(self.err, selectors.EVENT_READ)
        self.open = {self.out, self.err}
        self.stderr = bytearray()

    def _remove_conf(self) -> None:
        if self.conf:
            with contextlib.suppress(OSError):
                os.unlink(self.conf)

    def _drop(self, fd: int) -> None:
        self.selector.unregister(fd)
        self.open.discard(fd)

    def read(self, want: int, until: float) -> bytes:
        """Up to `want` bytes of stdout, b'' at its end; _Expired at `until` (monotonic)."""
        while self.out in self.open:
            left = until - time.monotonic()
            if left <= 0:
                raise _Expired
            data = b""
            for key, _events in self.selector.select(left):
                fd = int(key.fd)
                try:
                    chunk = os.read(fd, want if fd == self.out else STDERR_KEEP)
                except BlockingIOError:
                    continue
                if not chunk:
                    self._drop(fd)
                elif fd == self.out:
                    data = chunk
                elif len(self.stderr) < STDERR_KEEP:
                    self.stderr += chunk[: STDERR_KEEP - len(self.stderr)]
            if data:
                return data
        return b""

    def finish(self, until: float) -> int:
        """Wait for the end of stderr and the exit; the exit status. _Expired at `until`."""
        while self.open:
            if self.out in self.open:
                self.read(1 << 20, until)  # what is left of stdout is not wanted
                continue
            left = until - time.monotonic()
            if left <= 0:
                raise _Expired
            if self.selector.select(left):
                try:
                    chunk = os.read(self.err, STDERR_KEEP)
                except BlockingIOError:
                    continue
                if not chunk:
                    self._drop(self.err)
                elif len(self.stderr) < STDERR_KEEP:
                    self.stderr += chunk[: STDERR_KEEP - len(self.stderr)]
        try:
            return self.proc.wait(max(until - time.monotonic(), 0.001))
        except subprocess.TimeoutExpired:
            raise _Expired from None

    def close(self) -> None:
        """Stop the process group if it is still there (by the PID of the process started here,
        its leader), reap the process, close the pipes, remove the settings file."""
        try:
            if self.proc.poll() is None:
                for sig, wait in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, 10.0)):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(self.proc.pid, sig)
                    try:
                        self.proc.wait(wait)
                        break
                    except subprocess.TimeoutExpired:
                        continue
            else:  # the leader is gone; a child it left in the group is not wanted either
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
        finally:
            self.selector.close()
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream is not None:
                    stream.close()
            self._remove_conf()

    def failure(self, status: int) -> HadoopError:
        return classify(status, bytes(self.stderr))


def _run(
    config: Settings,
    args: Sequence[str],
    timeout: float,
    limit: int,
    too_much: str = "",
) -> bytes:
    """Run the client with `args` (retried within `timeout` while retryable): its stdout, at
    most `limit` bytes (more: HadoopError saying `too_much`, or the first `limit` bytes when
    `too_much` is '')."""
    deadline = time.monotonic() + timeout

    def attempt(_number: int) -> bytes:
        run = _Run(config, args)
        try:
            out = bytearray()
            while True:
                chunk = run.read(min(1 << 20, limit + 1 - len(out)), deadline)
                if not chunk:
                    break
                out += chunk
                if len(out) > limit:
                    if too_much:
                        raise HadoopError(too_much)
                    return bytes(out[:limit])
            status = run.finish(deadline)
            if status != 0:
                raise run.failure(status)
            return bytes(out)
        except _Expired:
            raise HadoopError(f"timed out after {timeout:g} s", retryable=True) from None
        finally:
            run.close()

    return retrying(attempt, BACKOFF, ATTEMPTS, _retryable, deadline=deadline)


def _retryable(exc: Exception) -> bool:
    return isinstance(exc, HadoopError) and exc.retryable


# ---------------------------------------------------------------------------------------------
# failures in our words

_EXCEPTION = re.compile(r"\b(?:[a-z_]\w*\.)+([A-Z]\w*(?:Exception|Error))\b")
_LOG_LINE = re.compile(r"^(?:\S+ \S+ )?(?:WARN|INFO|DEBUG|TRACE)\b|^log4j:|^SLF4J:")
_CAUSES: tuple[tuple[tuple[str, ...], str, dict[str, bool]], ...] = (
    (("No such file or directory", "FileNotFoundException", "does not exist"), "not found",
     {"missing": True}),
    (("Permission denied", "AccessControlException"), "access denied (check hadoop.job.ugi and "
     "the permissions)", {"denied": True}),
    (("Is a directory",), "is a directory, not a file", {}),
    (("Wrong FS", "No FileSystem for scheme", "UnsupportedFileSystemException",
      "Could not initialize target File System"),
     "the Hadoop client does not serve this URL's file system (check fs.default.name and the "
     "client's configuration)", {}),
    (("UnknownHostException",), "unknown namenode host (check the URL and fs.default.name)",
     {"retryable": True}),
    (("ConnectException", "Connection refused", "NoRouteToHostException",
      "ConnectTimeoutException", "SocketTimeoutException", "EOFException"),
     "cannot reach the namenode", {"retryable": True}),
    (("SafeModeException", "RetriableException", "StandbyException"),
     "the namenode is not serving yet (safe mode or standby)", {"retryable": True}),
    (("Illegal option", "Unknown command", "Usage:"),
     "the Hadoop client refused the command line (-ls -d and -ls -R need Hadoop 2 or later)", {}),
)  # fmt: skip


def classify(status: int, stderr: bytes) -> HadoopError:
    """A failed run (exit `status`, what it printed on stderr) in words of our own."""
    lines = stderr.decode("utf-8", "replace").splitlines()
    text = "\n".join(line for line in lines if not _LOG_LINE.match(line.strip()))
    for needles, message, kind in _CAUSES:
        if any(needle in text for needle in needles):
            return HadoopError(message, **kind)
    if status == 127:
        return HadoopError("the Hadoop client command was not found (exit 127)")
    if status < 0:
        return HadoopError(f"the Hadoop client was stopped by signal {-status}", retryable=True)
    names = list(dict.fromkeys(_EXCEPTION.findall(text)))[:2]
    said = f": {', '.join(names)}" if names else ""
    return HadoopError(f"the Hadoop client failed (exit {status}{said})", retryable=True)


# ---------------------------------------------------------------------------------------------
# listings

_ENTRY_START = re.compile(r"^[-dlbcps][-rwxXsStT]{9}")
_ENTRY = re.compile(
    r"(?P<perm>[-dlbcps][-rwxXsStT]{9}[+.@]?)\s+(?P<replication>-|\d+)\s+(?P<owner>\S+)\s+"
    r"(?P<group>\S+)\s+(?P<size>\d+)\s+(?P<date>\S+)\s+(?P<time>\S+)\s+(?P<path>\S.*)"
)
_FOUND = re.compile(r"Found (\d+) items?")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


@dataclass(frozen=True)
class Entry:
    path: str  # the path part of what the client printed: /dir/name
    size: int
    kind: str  # "file", "directory" or "other" (a link, a device, ...)


def entry_path(printed: str) -> str:
    """`/a/b` of `hdfs://nn:9000/a/b`, `hdfs:/a/b` or `/a/b`, taken literally (a '#' or '?' in
    a name is part of it, not a fragment or query)."""
    match = _SCHEME.match(printed)
    rest = printed[match.end() :] if match else printed
    if rest.startswith("//"):
        slash = rest.find("/", 2)
        rest = rest[slash:] if slash >= 0 else "/"
    return rest or "/"


def parse_listing(text: str) -> list[Entry]:
    """The entries of `-ls` (or `-ls -R`, `-ls -d`) output: `permissions replication owner
    group size date time path`, the path being the rest of the line (spaces and all). Lines
    that are no entry (a "Found N items" line, a warning) are skipped; HadoopError for a line
    that starts as an entry but cannot be read, or for fewer or more entries than the
    "Found N items" lines announce."""
    entries = []
    announced = None
    for line in text.split("\n"):
        line = line.removesuffix("\r")
        found = _FOUND.fullmatch(line.strip())
        if found:
            announced = (announced or 0) + int(found.group(1))
            continue
        if not _ENTRY_START.match(line):
            continue
        match = _ENTRY.fullmatch(line)
        if match is None:
            raise HadoopError("a line of the listing could not be read (not the -ls columns)")
        perm = match.group("perm")
        kind = "directory" if perm[0] == "d" else "file" if perm[0] == "-" else "other"
        entries.append(Entry(entry_path(match.group("path")), int(match.group("size")), kind))
    if announced is not None and announced != len(entries):
        raise HadoopError(
            f"the listing announced {announced} entries and {len(entries)} could be read"
        )
    return entries


# ---------------------------------------------------------------------------------------------
# the filesystem


def _info(entry: Entry) -> dict[str, Any]:
    return {"name": entry.path, "size": entry.size, "type": entry.kind}


class HadoopFileSystem:
    """The files of one `scheme://netloc` (netloc may be empty: fs.default.name's cluster)
    through the Hadoop client. Paths are URL paths (`/dir/name`); every method takes a
    `timeout` in seconds of wall time for all it runs."""

    async_impl = False
    bounded = True  # cube.remote.call passes its timeout to every method

    def __init__(self, scheme: str, netloc: str, config: Settings) -> None:
        self.protocol = (scheme,)
        self.scheme = scheme
        self.netloc = netloc
        self.config = config
        self._made: set[str] = set()  # directories made by put_file

    def url(self, path: str) -> str:
        return f"{self.scheme}://{self.netloc}{path if path.startswith('/') else '/' + path}"

    def _run(self, args: Sequence[str], timeout: float, limit: int, too_much: str = "") -> bytes:
        return _run(self.config, args, timeout, limit, too_much)

    def _list(self, args: Sequence[str], timeout: float) -> list[Entry]:
        text = self._run(args, timeout, LIST_LIMIT, f"a listing of more than {LIST_LIMIT} bytes")
        return parse_listing(text.decode("utf-8", "replace"))

    def info(self, path: str, timeout: float) -> dict[str, Any]:
        """name, size and type ("file", "directory", "other") of `path` (`-ls -d`)."""
        entries = self._list(["-ls", "-d", self.url(path)], timeout)
        if len(entries) != 1:
            raise HadoopError(f"-ls -d named {len(entries)} entries, not one (a glob?)")
        return _info(entries[0])

    def ls(self, path: str, timeout: float, detail: bool = True) -> list[Any]:
        """The entries of the directory `path` (or the file itself)."""
        entries = self._list(["-ls", self.url(path)], timeout)
        return [_info(e) if detail else e.path for e in entries]

    def find(
        self,
        path: str,
        timeout: float,
        detail: bool = True,
        withdirs: bool = False,
        **_ignored: Any,
    ) -> Any:
        """Every entry under `path`, recursively, in one run (`-ls -R`): path -> info (with
        `detail`; else the sorted paths); directories only `withdirs`."""
        entries = self._list(["-ls", "-R", self.url(path)], timeout)
        found = {e.path: _info(e) for e in entries if withdirs or e.kind != "directory"}
        return found if detail else sorted(found)

    def read_limited(self, path: str, limit: int, timeout: float) -> bytes:
        """The whole of the file `path` in one run (`-cat`); HadoopError when it holds more than
        `limit` bytes (the client is stopped at byte limit + 1)."""
        return self._run(
            ["-cat", self.url(path)], timeout, limit, f"more than the {limit} bytes allowed"
        )

    def stream(
        self, path: str, offset: int, size: int, block: int, io_timeout: float, deadline: float
    ) -> Iterator[bytes]:
        """The bytes `offset` to `size` of the file `path` (`-cat`, the first `offset` bytes
        skipped), in pieces of at most `block` bytes; each piece within `io_timeout` and all by
        `deadline` (monotonic). HadoopError when the file ends short of `size` (it changed);
        bytes past `size` are not read. Not retried: the caller's next attempt starts over."""
        run = _Run(self.config, ["-cat", self.url(path)])
        try:
            position = 0
            piece = bytearray()
            while position < size:
                until = min(deadline, time.monotonic() + io_timeout)
                chunk = run.read(min(1 << 20, size - position), until)
                if not chunk:
                    status = run.finish(min(deadline, time.monotonic() + io_timeout))
                    if status != 0:
                        raise run.failure(status)
                    raise HadoopError(
                        f"the file ended at byte {position} of {size} (did it change?)",
                        retryable=True,
                    )
                keep = chunk[max(offset - position, 0) :]
                position += len(chunk)
                piece += keep
                while len(piece) >= block or (position >= size and piece):
                    yield bytes(piece[:block])
                    del piece[:block]
        except _Expired:
            raise HadoopError("timed out", retryable=True) from None
        finally:
            run.close()

    def put_file(self, lpath: str, rpath: str, timeout: float, **_ignored: Any) -> None:
        """Copy the local file `lpath` to `rpath` (`-put -f`: the client writes a temporary
        name and renames it, so the file appears whole), making its directory first
        (`-mkdir -p`, once per directory for this filesystem)."""
        deadline = time.monotonic() + timeout
        parent = rpath.rsplit("/", 1)[0] or "/"
        if parent not in self._made:
            self._run(["-mkdir", "-p", self.url(parent)], timeout, 1 << 20)
            self._made.add(parent)
        left = max(deadline - time.monotonic(), 0.001)
        try:
            self._run(
                ["-put", "-f", Path(lpath).absolute().as_uri(), self.url(rpath)], left, 1 << 20
            )
        except HadoopError as exc:
            if exc.missing:
                self._made.discard(parent)  # removed meanwhile: made again at the next try
            raise

    def get_files(self, files: Sequence[tuple[str, Path, int]], timeout: float) -> None:
        """Copy each (remote path, local destination, size) with as few runs as the command
        line allows (`-get` of many files, no two of the same name, into a staging directory
        beside the first destination, then renamed into place); HadoopError when a copy's size
        is not the one given (the file changed after it was listed)."""
        deadline = time.monotonic() + timeout
        for batch in _batches(files):
            try:
                staging = Path(tempfile.mkdtemp(prefix=".hadoop-get-", dir=_made_dir(batch[0][1])))
            except OSError as exc:
                raise HadoopError(f"cannot write {batch[0][1].parent}: {exc.strerror}") from None
            try:
                sources = [self.url(remote) for remote, _dest, _size in batch]
                left = max(deadline - time.monotonic(), 0.001)
                # a local path as a file:// URI: the client refuses one with a space otherwise
                self._run(["-get", *sources, staging.as_uri()], left, 1 << 20)
                for remote, dest, size in batch:
                    _place(staging / remote.rsplit("/", 1)[-1], dest, size)
            except OSError as exc:  # here, not the cluster
                raise HadoopError(f"cannot write {exc.filename}: {exc.strerror}") from None
            finally:
                shutil.rmtree(staging, ignore_errors=True)


def _place(got: Path, dest: Path, size: int) -> None:
    """Move the copy `got` to `dest` if it holds `size` bytes."""
    found = got.stat().st_size if got.is_file() else -1
    if found != size:
        raise HadoopError(
            f"a copy holds {found} bytes where the listing said {size} (did the file change?)",
            retryable=True,
        )
    _made_dir(dest)
    os.replace(got, dest)


def _made_dir(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest.parent


def _batches(files: Sequence[tuple[str, Path, int]]) -> Iterator[list[tuple[str, Path, int]]]:
    """`files` in runs of at most BATCH_ARGS characters of paths, no two with the same base
    name (one -get puts them all in one local directory): a run for a flat directory,
    more when the names of sub-directories' files meet."""
    batch: list[tuple[str, Path, int]] = []
    length = 0
    names: set[str] = set()
    for item in files:
        name = item[0].rpartition("/")[2]
        if batch and (length + len(item[0]) > BATCH_ARGS or name in names):
            yield batch
            batch, length, names = [], 0, set()
        batch.append(item)
        length += len(item[0]) + 1
        names.add(name)
    if batch:
        yield batch
