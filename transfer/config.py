"""transfer.conf: the original's INI dialect, parsed into a validated `TransferConfig`.

The format is the original cube-transfer's: `[section]` headers, `key: value` lines (`key = value`
is accepted too), `#` comments (whole line, or after whitespace at the end of a value). Section
`[default]` holds the dictionary and paths, `[cube_agent]` one `agent<i>_<j>: ip:port` and one
`cube<i>_<j>: ip:port:deploy_path` per replica j of shard i. Keys we add (quorum, timeouts,
retries, partitioner, agent_token, listen, ...) are optional, so an original file still parses.

Keys we add to [default] (all optional; default in brackets):
- `listen` [transfer_address]: bind address of the query API and the file server.
- `quorum` [copy_num]: replicas per shard that must have loaded a version before any switches.
- `phase_timeout` [600], `download_timeout`, `reload_timeout` [phase_timeout], `enable_timeout`
  [min(phase_timeout, 120)], `build_timeout` [3600], `fetch_timeout` [3600]: seconds.
- `retries` [3]: failed agent tasks re-sent per phase and instance.
- `version_retries` [8], `version_retry_backoff` [30]: a version whose rollout failed for a
  reason that may pass (replicas unreachable, quorum missed, input not there yet, a timeout)
  is rolled out again up to version_retries times, the first retry version_retry_backoff
  seconds after the failure, each wait twice the last, at most max(600, backoff) seconds.
- `partitioner` [mod]: mod | murmur3, passed to the builder.
- `agent_token` [env CUBE_TOKEN]: sent to every agent as `Authorization: Bearer`.
- `api_token` [env CUBE_API_TOKEN]: when set, every request to the query API must carry it
  (header `Authorization: Bearer <token>`, or a `token` field in a POST body), reads included.
  A `listen` address beyond loopback without it refuses to start unless `insecure: true`.
- `agent_token_file`, `api_token_file` [none]: the same tokens from a file (one a line: the
  first is sent, each is accepted), read again when it changes (`cube.security.Token`);
  instead of the key (both: refused) or its environment variable.
- `insecure` [false]: allow the API beyond loopback without `api_token`.
- `tls_cert`, `tls_key` [none]: PEM files; the query API and the http file server speak TLS
  (agents are then sent https:// sources and need the CA: cube-agent --tls_ca).
- `agent_tls_ca` [none]: PEM CA bundle; agents are called over https (cube-agent --tls_cert)
  trusting it.
- `verify_output` [true]: check every built tar's md5 and members before deploying it.
- `history_limit` [500]: version records kept (live and pending ones always are).
- `max_shrink` [0.5]: a new base with fewer records than (1 - max_shrink) x the live version's
  is refused (status `refused`, the reason in its history record, the journal and the log)
  before anything is downloaded; 1 turns the check off, 0 refuses any shrink. The live
  version's count is its base's records minus the deletions of its deltas (a lower bound of
  what is served, so deltas that update keys never cause a refusal); counts come from the
  built shards' index headers.
- `allow_empty_base` [false]: a base with no records at all is refused unless this is true
  (both checks apply: an empty base replacing a live one also needs max_shrink 1).
- `variable_width` [false]: the dictionary's values may vary in width. Otherwise a delta whose
  values have another width than the live chain's is refused before download (clients reading
  fixed-width values would fail on every lookup); passed to the builder as -variable_width.
- `builder_flags` [none]: more flags for the builder, after the ones the transfer sets, split as
  a shell would split them (never run by one), e.g. `-engine spark -spark_master yarn`; the
  flags the transfer sets itself (input, output, versions, shards, mode) are refused here.
- `mirror_input` [true]: copy a remote input (http, ftp, s3, webhdfs) to tmp_address before the
  builder runs; false hands the builder the URL itself (cube-builder fetches it; with
  `-engine spark` each executor fetches its own files, so the transfer's disk never holds them).
- `source_format` [seqfile]: who writes the donefiles and what their inputs are
  (cube.donefile.DONEFILE_FORMATS): `seqfile` (base.txt / patch.txt, SequenceFiles unless
  builder_flags say otherwise), `paddle_fleet` (xbox_base_done.txt / xbox_patch_done.txt, from
  Paddle's FleetUtil) or `paddlerec` (base_donefile.txt / patch_donefile.txt, from PaddleRec's
  streaming trainer): parameter-server saves, built with -input_format paddle_ps (the layout
  flags go in builder_flags), each from its save directory.
- `paddlerec_workdir` [none]: with `source_format: paddlerec`, the directory PaddleRec's trainer
  ran in, as this transfer sees it (a path, relative to this file, or a URL): a relative
  `input` of its donefiles is relative to it, as PaddleRec wrote it. Without it, such an
  input is found in the donefile's own directory when that is the folder the input starts
  with (runner.model_save_path: PaddleRec writes its donefiles there; by the name given or,
  through a symbolic link, its real name), else refused with the reason
  (cube.donefile.paddlerec_relative_input; docs/paddle.md).
- `upload_address` [none]: with `download_mode: s3`, the s3://bucket/prefix each built version's
  tars and md5s are uploaded to (transfer/upload.py); agents download from there.
- `download_address` [none]: with `download_mode: http` or `ftp`, the URL of a file server
  that already serves `output_address` (an http(s):// or ftp:// URL, as the mode says); agents
  are sent `<download_address>/<depend>_<id>/<dict>_part<i>.tar`, and the transfer runs no file
  server (`wget_port` is not bound). The original's URLs, `http://<transfer_address>:
  <wget_port><output_address>/...`, come from a server on wget_port serving `/`:
  `download_address: http://<transfer_address>:<wget_port><output_address>`.
A base line may override both with `"allow_shrink": true` (see cube/donefile.py); a
patch may always be empty. A refused line can be published again with it.

Parsing is pure (text in, config out); errors name the file, line and key.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from cube import remote
from cube.backoff import Backoff
from cube.donefile import DONEFILE_FORMATS, DonefileFormat
from cube.routing import PARTITIONERS
from cube.security import Token
from cube.transfer.build import TRANSFER_SET_FLAGS, builder_settings_problem
from cube.transfer.donefile import address_problem
from cube.transfer.state import RetryPolicy

log = logging.getLogger("cube.transfer")

MODES = ("base_only", "base_delta")
DOWNLOAD_MODES = ("http", "ftp", "s3")
_INSTANCE_KEY = re.compile(r"(agent|cube)(\d+)_(\d+)")
_HOSTPORT = re.compile(r"\[?([A-Za-z0-9.\-:]+?)\]?:(\d{1,5})")
_DICT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class ConfigError(ValueError):
    """A transfer.conf that cannot be used; the message names the place."""


# The keys of [default] cube-transfer reads (docs/reference/transfer-conf.md lists each).
DEFAULT_KEYS = frozenset({
    "dict_name", "mode", "download_mode", "wget_port", "buildtool_local", "donefile_address",
    "output_address", "tmp_address", "shard_num", "copy_num", "transfer_address",
    "deploy_path", "listen", "quorum", "phase_timeout", "download_timeout", "reload_timeout",
    "enable_timeout", "build_timeout", "fetch_timeout", "retries", "partitioner",
    "agent_token", "api_token", "agent_token_file", "api_token_file", "verify_output",
    "history_limit", "max_shrink",
    "allow_empty_base", "insecure", "tls_cert", "tls_key", "agent_tls_ca", "upload_address",
    "builder_flags", "mirror_input", "download_address", "variable_width", "version_retries",
    "version_retry_backoff", "source_format", "paddlerec_workdir",
})  # fmt: skip


@dataclass(frozen=True)
class Instance:
    """One replica of one shard: a cube-server and the cube-agent beside it."""

    shard: int
    replica: int
    agent_host: str
    agent_port: int
    server_host: str
    server_port: int
    deploy_path: str

    @property
    def name(self) -> str:
        return f"{self.shard}_{self.replica}"

    @property
    def agent_address(self) -> str:
        return f"{self.agent_host}:{self.agent_port}"

    @property
    def server_address(self) -> str:
        return f"{self.server_host}:{self.server_port}"


@dataclass(frozen=True)
class TransferConfig:
    dict_name: str
    mode: str
    download_mode: str
    wget_port: int
    buildtool_local: str
    donefile_address: str
    output_address: Path
    tmp_address: Path
    shard_num: int
    copy_num: int
    transfer_address: str
    instances: tuple[Instance, ...]
    # ours (all optional in the file)
    listen: str = "127.0.0.1"  # bind address of the API and file server (default: transfer_address)
    quorum: int = 0  # replicas per shard that must have loaded before any shard switches
    download_timeout: float = 600.0
    reload_timeout: float = 600.0
    enable_timeout: float = 120.0
    build_timeout: float = 3600.0
    fetch_timeout: float = 3600.0
    retries: int = 3
    version_retries: int = 8  # a failed version's rollout is tried again this many times
    version_retry_backoff: float = 30.0  # seconds before the first retry (then doubling)
    partitioner: str = "mod"
    agent_token: str = ""
    api_token: str = ""
    agent_token_file: str = ""  # instead of agent_token: re-read when it changes
    api_token_file: str = ""
    insecure: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    agent_tls_ca: str = ""
    verify_output: bool = True
    history_limit: int = 500
    max_shrink: float = 0.5  # a base may have at most this fraction fewer records than live
    allow_empty_base: bool = False
    variable_width: bool = False  # a delta may change the dictionary's value width
    upload_address: str = ""  # download_mode s3: s3://bucket/prefix the builds are uploaded to
    download_address: str = ""  # http/ftp: an external file server's URL of output_address

    @property
    def retry_policy(self) -> RetryPolicy:
        """How a failed version is tried again (version_retries, version_retry_backoff)."""
        backoff = self.version_retry_backoff
        return RetryPolicy(self.version_retries, Backoff(backoff, max(600.0, backoff)))

    def agent_token_source(self) -> Token:
        """The agents' token (agent_token, or agent_token_file followed as it changes);
        SecurityError when the file cannot be read."""
        return Token(self.agent_token, self.agent_token_file)

    def api_token_source(self) -> Token:
        """The query API's token (api_token, or api_token_file followed as it changes)."""
        return Token(self.api_token, self.api_token_file)

    @property
    def serves_files(self) -> bool:
        """Whether the transfer runs its own file server on wget_port."""
        return self.download_mode != "s3" and not self.download_address

    builder_flags: tuple[str, ...] = ()  # appended to the builder's argv
    mirror_input: bool = True  # False: remote inputs go to the builder as URLs
    source_format: str = "seqfile"  # cube.donefile.DONEFILE_FORMATS: the donefiles' writer
    paddlerec_workdir: str = ""  # PaddleRec's trainer's working directory: relative inputs

    @property
    def donefile_format(self) -> DonefileFormat:
        return DONEFILE_FORMATS[self.source_format]

    @property
    def paddle_saves(self) -> bool:
        """Whether inputs are parameter-server saves: the source format says so, or the
        builder is told to read them (builder_flags -input_format paddle_ps)."""
        return (
            self.donefile_format.paddle_saves
            or _flag_value(self.builder_flags, "input_format") == "paddle_ps"
        )

    extra: dict[str, str] = field(default_factory=dict)

    def shard_instances(self, shard: int) -> list[Instance]:
        return [inst for inst in self.instances if inst.shard == shard]

    def instance(self, name: str) -> Instance:
        for inst in self.instances:
            if inst.name == name:
                return inst
        raise KeyError(name)


def parse_ini(text: str, source: str = "transfer.conf") -> dict[str, dict[str, tuple[str, int]]]:
    """Sections -> key -> (value, line number). Keys are lower-cased; a repeated key is an
    error (the original silently kept one of them)."""
    sections: dict[str, dict[str, tuple[str, int]]] = {}
    current: dict[str, tuple[str, int]] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = _strip_comment(raw).strip()
        if not line:
            continue
        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                raise ConfigError(f"{source}:{number}: bad section header {raw.strip()!r}")
            current = sections.setdefault(line[1:-1].strip().lower(), {})
            continue
        separators = [i for i in (line.find(":"), line.find("=")) if i > 0]
        if not separators:
            raise ConfigError(f"{source}:{number}: expected 'key: value', got {raw.strip()!r}")
        cut = min(separators)
        key, value = line[:cut].strip().lower(), line[cut + 1 :].strip()
        if current is None:
            raise ConfigError(f"{source}:{number}: key {key!r} is outside any [section]")
        if key in current:
            raise ConfigError(
                f"{source}:{number}: key {key!r} repeats line {current[key][1]} of its section"
            )
        current[key] = (value, number)
    return sections


def _strip_comment(line: str) -> str:
    stripped = line.lstrip()
    if stripped.startswith(("#", ";", "//")):
        return ""
    for marker in (" #", "\t#", " //", "\t//"):
        cut = line.find(marker)
        if cut >= 0:
            line = line[:cut]
    return line


class _Default:
    """The [default] section's values, read as typed values; errors name file, line and key."""

    def __init__(self, section: dict[str, tuple[str, int]], source: str, base_dir: Path) -> None:
        self.section, self.source, self.base_dir = section, source, base_dir

    def where(self, key: str) -> str:
        return f"{self.source}:{self.section[key][1]}" if key in self.section else self.source

    def text(self, key: str, fallback: str | None = None) -> str:
        if key in self.section and self.section[key][0] != "":
            return self.section[key][0]
        if fallback is None:
            raise ConfigError(f"{self.source}: [default] needs {key}")
        return fallback

    def integer(
        self, key: str, fallback: int | None = None, low: int = 0, high: int = 1 << 31
    ) -> int:
        raw = self.text(key, None if fallback is None else str(fallback))
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(
                f"{self.where(key)}: {key}: expected an integer, got {raw!r}"
            ) from None
        if not low <= value <= high:
            raise ConfigError(f"{self.where(key)}: {key}: {value} is outside [{low}, {high}]")
        return value

    def number(self, key: str, fallback: float, ok: Callable[[float], bool], rule: str) -> float:
        raw = self.text(key, str(fallback))
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{self.where(key)}: {key}: expected a number, got {raw!r}") from None
        if not ok(value):
            raise ConfigError(f"{self.where(key)}: {key}: must be {rule}, got {raw}")
        return value

    def positive(self, key: str, fallback: float) -> float:
        return self.number(key, fallback, lambda v: v > 0, "> 0")

    def fraction(self, key: str, fallback: float) -> float:
        return self.number(key, fallback, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")

    def choice(self, key: str, choices: tuple[str, ...], fallback: str) -> str:
        value = self.text(key, fallback)
        if value not in choices:
            raise ConfigError(
                f"{self.where(key)}: {key}: {value!r} is not one of {', '.join(choices)}"
            )
        return value

    def path(self, key: str) -> Path:
        path = Path(self.text(key)).expanduser()
        return path if path.is_absolute() else (self.base_dir / path).resolve()

    def flag(self, key: str, fallback: bool) -> bool:
        raw = self.text(key, "true" if fallback else "false").lower()
        if raw in ("true", "1", "yes", "on"):
            return True
        if raw in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{self.where(key)}: {key}: expected true or false, got {raw!r}")


def parse_config(
    text: str, source: str = "transfer.conf", base_dir: Path | None = None
) -> TransferConfig:
    """Validate the sections into a TransferConfig. Relative paths are taken relative to
    `base_dir` (the config file's directory)."""
    sections = parse_ini(text, source)
    if "default" not in sections:
        raise ConfigError(f"{source}: no [default] section")
    d = _Default(sections["default"], source, base_dir or Path.cwd())
    dict_name = _dict_name(d)
    shard_num = d.integer("shard_num", low=1, high=100000)
    copy_num = d.integer("copy_num", 1, low=1, high=1000)
    quorum = d.integer("quorum", copy_num, low=1, high=copy_num)
    phase_timeout = d.positive("phase_timeout", 600.0)
    donefile = _donefile_address(d)
    download_mode = d.choice("download_mode", DOWNLOAD_MODES, "http")
    upload = _upload_address(d, download_mode)
    download_address = _download_address(
        d.text("download_address", ""), download_mode, d.where("download_address")
    )
    source_format = d.choice("source_format", tuple(DONEFILE_FORMATS), "seqfile")
    builder_flags = _builder_flags(
        d.text("builder_flags", ""),
        d.where("builder_flags"),
        DONEFILE_FORMATS[source_format].paddle_saves,
    )
    _check_builder_settings(d, builder_flags, DONEFILE_FORMATS[source_format].paddle_saves)
    _check_unknown_keys(d)
    transfer_address = d.text("transfer_address", "127.0.0.1")
    return TransferConfig(
        dict_name=dict_name,
        mode=d.choice("mode", MODES, "base_only"),
        download_mode=download_mode,
        # 0: any free port; unused with download_mode s3 (agents download from upload_address)
        # or a download_address (an external file server)
        wget_port=d.integer(
            "wget_port",
            0 if download_mode == "s3" or download_address else None,
            low=0,
            high=65535,
        ),
        buildtool_local=d.text("buildtool_local", "cube-builder"),
        donefile_address=donefile,
        output_address=d.path("output_address"),
        tmp_address=d.path("tmp_address"),
        shard_num=shard_num,
        copy_num=copy_num,
        transfer_address=transfer_address,
        instances=tuple(
            _parse_instances(sections.get("cube_agent", {}), shard_num, copy_num, source)
        ),
        listen=d.text("listen", transfer_address),
        quorum=quorum,
        download_timeout=d.positive("download_timeout", phase_timeout),
        reload_timeout=d.positive("reload_timeout", phase_timeout),
        enable_timeout=d.positive("enable_timeout", min(phase_timeout, 120.0)),
        build_timeout=d.positive("build_timeout", 3600.0),
        fetch_timeout=d.positive("fetch_timeout", 3600.0),
        retries=d.integer("retries", 3, low=0, high=100),
        version_retries=d.integer("version_retries", 8, low=0, high=1000),
        version_retry_backoff=d.positive("version_retry_backoff", 30.0),
        partitioner=d.choice("partitioner", PARTITIONERS, "mod"),
        **_tokens(d),
        insecure=d.flag("insecure", False),
        tls_cert=d.text("tls_cert", ""),
        tls_key=d.text("tls_key", ""),
        agent_tls_ca=d.text("agent_tls_ca", ""),
        verify_output=d.flag("verify_output", True),
        history_limit=d.integer("history_limit", 500, low=10, high=100000),
        max_shrink=d.fraction("max_shrink", 0.5),
        allow_empty_base=d.flag("allow_empty_base", False),
        variable_width=d.flag("variable_width", False),
        upload_address=upload,
        download_address=download_address,
        builder_flags=builder_flags,
        mirror_input=d.flag("mirror_input", True),
        source_format=source_format,
        paddlerec_workdir=_paddlerec_workdir(d, source_format),
        extra={k: v for k, (v, _) in d.section.items() if k not in DEFAULT_KEYS},
    )


def _check_builder_settings(d: _Default, flags: tuple[str, ...], paddle_saves: bool) -> None:
    """ConfigError naming the key when cube-builder would refuse the flags every build gets
    from here (found now, not by a version abandoned at its build)."""
    tool = d.text("buildtool_local", "cube-builder")
    problem = builder_settings_problem(tool, flags, paddle_saves)
    if problem:
        key = "builder_flags" if flags else "source_format"
        raise ConfigError(f"{d.where(key)}: {key}: {problem}")


def _paddlerec_workdir(d: _Default, source_format: str) -> str:
    """paddlerec_workdir: a local directory (absolute, relative to the config's) or a URL."""
    text = d.text("paddlerec_workdir", "")
    if not text:
        return ""
    where = f"{d.where('paddlerec_workdir')}: paddlerec_workdir"
    if source_format != "paddlerec":
        raise ConfigError(
            f"{where}: only with source_format: paddlerec (where PaddleRec's trainer ran: "
            "relative inputs of its donefiles)"
        )
    if not urlsplit(text).scheme:
        return str(d.path("paddlerec_workdir"))
    problem = address_problem(text)
    if problem:
        raise ConfigError(f"{where}: {problem}")
    return text


def _dict_name(d: _Default) -> str:
    dict_name = d.text("dict_name")
    if not _DICT_NAME.fullmatch(dict_name) or ".." in dict_name:
        raise ConfigError(f"{d.where('dict_name')}: dict_name {dict_name!r} is not a plain name")
    return dict_name


def _donefile_address(d: _Default) -> str:
    """A URL as written, or a local path made absolute; either must be one we can read."""
    donefile = d.text("donefile_address")
    if "://" not in donefile:
        donefile = str(d.path("donefile_address"))
    problem = address_problem(donefile)
    if problem:
        raise ConfigError(f"{d.where('donefile_address')}: donefile_address: {problem}")
    return donefile


def _upload_address(d: _Default, download_mode: str) -> str:
    """The s3:// prefix builds are uploaded to: required with download_mode s3, refused else."""
    upload = d.text("upload_address", "")
    if download_mode == "s3":
        if remote.scheme_of(upload) != "s3":
            raise ConfigError(
                f"{d.where('upload_address')}: download_mode s3 needs upload_address: "
                "s3://bucket/prefix (where the builds are uploaded for the agents)"
            )
        problem = address_problem(upload)
        if problem:
            raise ConfigError(f"{d.where('upload_address')}: upload_address: {problem}")
    elif upload:
        raise ConfigError(
            f"{d.where('upload_address')}: upload_address is used only with download_mode: s3"
        )
    return upload


def _check_unknown_keys(d: _Default) -> None:
    """A key close to a known one is an error (a typo would silently leave the default in
    place); any other unknown key is logged and kept (TransferConfig.extra)."""
    for key, (_value, line) in d.section.items():
        if key in DEFAULT_KEYS:
            continue
        close = difflib.get_close_matches(key, DEFAULT_KEYS, n=1, cutoff=0.8)
        if close:
            raise ConfigError(f"{d.source}:{line}: unknown key {key!r}; did you mean {close[0]}?")
        log.warning("%s:%d: key %r is not one cube-transfer uses (ignored)", d.source, line, key)


def _parse_instances(
    section: dict[str, tuple[str, int]], shard_num: int, copy_num: int, source: str
) -> list[Instance]:
    agents: dict[tuple[int, int], tuple[str, int]] = {}
    servers: dict[tuple[int, int], tuple[str, int, str]] = {}
    for key, (value, line) in section.items():
        match = _INSTANCE_KEY.fullmatch(key)
        if not match:
            raise ConfigError(
                f"{source}:{line}: [cube_agent] key {key!r} is not agent<i>_<j> or cube<i>_<j>"
            )
        kind, shard, replica = match.group(1), int(match.group(2)), int(match.group(3))
        if shard >= shard_num or replica >= copy_num:
            raise ConfigError(
                f"{source}:{line}: {key}: shard {shard} replica {replica} is outside "
                f"shard_num={shard_num} copy_num={copy_num}"
            )
        if kind == "agent":
            agents[(shard, replica)] = _host_port(value, f"{source}:{line}: {key}")
        else:
            host_port, sep, deploy_path = _split_server(value)
            if not sep or not deploy_path:
                raise ConfigError(
                    f"{source}:{line}: {key}: expected ip:port:deploy_path, got {value!r}"
                )
            host, port = _host_port(host_port, f"{source}:{line}: {key}")
            servers[(shard, replica)] = (host, port, deploy_path)
    instances = []
    for shard in range(shard_num):
        for replica in range(copy_num):
            if (shard, replica) not in agents:
                raise ConfigError(f"{source}: [cube_agent] needs agent{shard}_{replica}: ip:port")
            if (shard, replica) not in servers:
                raise ConfigError(
                    f"{source}: [cube_agent] needs cube{shard}_{replica}: ip:port:deploy_path"
                )
            agent_host, agent_port = agents[(shard, replica)]
            server_host, server_port, deploy_path = servers[(shard, replica)]
            instances.append(
                Instance(
                    shard, replica, agent_host, agent_port, server_host, server_port, deploy_path
                )
            )
    # One agent may serve several instances (cube-agent --instances), told apart by deploy_path
    by_place: dict[tuple[str, str], str] = {}
    for inst in instances:
        place = (inst.agent_address, inst.deploy_path)
        if place in by_place:
            raise ConfigError(
                f"{source}: [cube_agent] instances {by_place[place]} and {inst.name} share agent "
                f"{inst.agent_address} and deploy_path {inst.deploy_path!r}: an agent tells its "
                "instances apart by their deploy_path"
            )
        by_place[place] = inst.name
    return instances


def _split_server(value: str) -> tuple[str, str, str]:
    """`ip:port:deploy_path` -> (`ip:port`, ':', deploy_path); the path may contain ':'."""
    first = value.find(":")
    second = value.find(":", first + 1) if first >= 0 else -1
    if second < 0:
        return value, "", ""
    return value[:second], ":", value[second + 1 :]


def _host_port(value: str, where: str) -> tuple[str, int]:
    match = _HOSTPORT.fullmatch(value.strip())
    if not match or not 0 < int(match.group(2)) < 65536:
        raise ConfigError(f"{where}: expected ip:port, got {value!r}")
    return match.group(1), int(match.group(2))


def _tokens(d: _Default) -> dict[str, str]:
    """agent_token and api_token (else their environment variables), or their `_file`s (a
    token and its file: refused)."""
    found = {}
    for key, env in (("agent_token", "CUBE_TOKEN"), ("api_token", "CUBE_API_TOKEN")):
        path = found[f"{key}_file"] = d.text(f"{key}_file", "")
        if path and d.text(key, ""):
            raise ConfigError(f"{d.where(key)}: {key} and {key}_file: give one")
        found[key] = "" if path else d.text(key, os.environ.get(env, ""))
    return found


def load_config(path: str | os.PathLike[str]) -> TransferConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    return parse_config(text, str(path), path.resolve().parent)


# Flags the transfer passes to the builder itself (transfer/build.py: builder_argv).
def _builder_flags(text: str, where: str, paddle_source: bool = False) -> tuple[str, ...]:
    """builder_flags split like a shell would; ConfigError for bad quoting or a flag the
    transfer sets itself (a second -output_path would build somewhere the transfer never
    looks; -input_format when source_format names a trainer's donefiles)."""
    try:
        flags = tuple(shlex.split(text, comments=False))
    except ValueError as exc:
        raise ConfigError(f"{where}: builder_flags: {exc}") from None
    for flag in flags:
        name = flag.lstrip("-").partition("=")[0]
        if flag.startswith("-") and name in TRANSFER_SET_FLAGS:
            raise ConfigError(
                f"{where}: builder_flags: {flag.partition('=')[0]} is set by cube-transfer "
                "(from the config and the donefile line); leave it out"
            )
        if flag.startswith("-") and name == "input_format" and paddle_source:
            raise ConfigError(
                f"{where}: builder_flags: {flag.partition('=')[0]} is set by cube-transfer "
                "(source_format names parameter-server saves: -input_format paddle_ps); "
                "leave it out"
            )
    missing = paddle_layout_missing(flags) if paddle_source else []
    if missing:
        raise ConfigError(
            f"{where}: builder_flags: source_format names parameter-server saves, whose "
            f"row layout the builder needs: add -paddle_config FILE (the trainer's "
            f"PSParameter text), or {', '.join(missing)}"
        )
    return flags


def paddle_layout_missing(flags: tuple[str, ...]) -> list[str]:
    """The layout flags a build of parameter-server saves lacks in builder flags `flags`:
    none with -paddle_config (the trainer's PSParameter text says it all), else those of
    -paddle_accessor, -paddle_dim, -paddle_optimizer not given."""
    if _flag_value(flags, "paddle_config") is not None:
        return []
    layout = ("paddle_accessor", "paddle_dim", "paddle_optimizer")
    return [f"-{name}" for name in layout if _flag_value(flags, name) is None]


def _flag_value(flags: tuple[str, ...], name: str) -> str | None:
    """The value of `-name v` / `--name=v` in a builder argv tail (the last one), else None."""
    value = None
    for i, flag in enumerate(flags):
        if not flag.startswith("-"):
            continue
        flag_name, eq, inline = flag.lstrip("-").partition("=")
        if flag_name != name:
            continue
        if eq:
            value = inline
        elif i + 1 < len(flags):
            value = flags[i + 1]
    return value


_DOWNLOAD_SCHEMES = {"http": ("http", "https"), "ftp": ("ftp",)}


def _download_address(text: str, download_mode: str, where: str) -> str:
    """download_address checked: a URL of the mode's scheme, no query or fragment (a path is
    appended to it); '' when not given."""
    if not text:
        return ""
    schemes = _DOWNLOAD_SCHEMES.get(download_mode)
    if schemes is None:
        raise ConfigError(
            f"{where}: download_address is for download_mode http or ftp (with s3, agents "
            "download from upload_address)"
        )
    parts = urlsplit(text)
    if parts.scheme not in schemes or not parts.hostname:
        raise ConfigError(
            f"{where}: download_address: expected a {' or '.join(schemes)}:// URL with a host "
            f"(download_mode {download_mode}), got {remote.redact(text)!r}"
        )
    if parts.query or parts.fragment:
        raise ConfigError(f"{where}: download_address: no query or fragment: a path is appended")
    problem = address_problem(text)
    if problem:
        raise ConfigError(f"{where}: download_address: {problem}")
    return text.rstrip("/")


def render_config(cfg: TransferConfig) -> str:
    """A transfer.conf that parses back into `cfg`, every field included (cube-local writes
    it; a field left out would silently fall back to its default, e.g. an open API)."""
    lines = [
        "# cube-transfer configuration (the original's format; extra keys are ours)",
        "[default]",
        f"dict_name: {cfg.dict_name}",
        f"mode: {cfg.mode}",
        f"download_mode: {cfg.download_mode}",
        f"wget_port: {cfg.wget_port}",
        f"buildtool_local: {cfg.buildtool_local}",
        f"donefile_address: {cfg.donefile_address}",
        f"output_address: {cfg.output_address}",
        f"tmp_address: {cfg.tmp_address}",
        f"shard_num: {cfg.shard_num}",
        f"copy_num: {cfg.copy_num}",
        f"transfer_address: {cfg.transfer_address}",
        f"listen: {cfg.listen}",
        f"quorum: {cfg.quorum}",
        f"download_timeout: {cfg.download_timeout!r}",
        f"reload_timeout: {cfg.reload_timeout!r}",
        f"enable_timeout: {cfg.enable_timeout!r}",
        f"build_timeout: {cfg.build_timeout!r}",
        f"fetch_timeout: {cfg.fetch_timeout!r}",
        f"retries: {cfg.retries}",
        f"version_retries: {cfg.version_retries}",
        f"version_retry_backoff: {cfg.version_retry_backoff!r}",
        f"partitioner: {cfg.partitioner}",
        f"verify_output: {'true' if cfg.verify_output else 'false'}",
        f"history_limit: {cfg.history_limit}",
        f"max_shrink: {cfg.max_shrink!r}",
        f"allow_empty_base: {'true' if cfg.allow_empty_base else 'false'}",
        f"variable_width: {'true' if cfg.variable_width else 'false'}",
        f"insecure: {'true' if cfg.insecure else 'false'}",
    ]
    lines.append(f"mirror_input: {'true' if cfg.mirror_input else 'false'}")
    lines.append(f"source_format: {cfg.source_format}")
    if cfg.builder_flags:
        lines.append(f"builder_flags: {shlex.join(cfg.builder_flags)}")
    for key in ("tls_cert", "tls_key", "agent_tls_ca", "upload_address", "download_address",
                "agent_token_file", "api_token_file", "paddlerec_workdir"):  # fmt: skip
        if getattr(cfg, key):
            lines.append(f"{key}: {getattr(cfg, key)}")
    for key, token in (("agent_token", cfg.agent_token), ("api_token", cfg.api_token)):
        if token and (token != token.strip() or any(c.isspace() for c in token)):
            raise ConfigError(f"{key}: a token with whitespace cannot be written to transfer.conf")
        if token:
            lines.append(f"{key}: {token}")
    for key, value in cfg.extra.items():
        lines.append(f"{key}: {value}")
    lines += ["", "[cube_agent]"]
    for inst in cfg.instances:
        lines.append(f"agent{inst.shard}_{inst.replica}: {inst.agent_address}")
        lines.append(f"cube{inst.shard}_{inst.replica}: {inst.server_address}:{inst.deploy_path}")
    return "\n".join(lines) + "\n"
