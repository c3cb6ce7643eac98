"""cube-server: serves one shard of a dictionary from mmap'd shard files over gRPC.

Modules: `main` (flags, process and worker supervision), `service` (lookup handlers and the
vectorized kernel + wire encoders), `lane` (the TCP lane), `control` (ControlService
commands, coordinated over the worker processes), `versions` (data layout, chains, loading,
the current/background slots).

Services (every worker port; all on raw-bytes generic handlers, listed by reflection):
- `cube.v1.CubeService/Seek`: keys = packed LE uint64; answer `found` (1 byte per key),
  `values` (fixed width: n * value_width zero-filled; else found values back to back plus
  `offsets`, n+1 LE uint64), `version`, `request_id` echoed. Optional `dict_name` (empty, the
  --dict_name, or `<dict>_part<--shard>`; else NOT_FOUND) and `version` (current or the loaded
  background/previous one; else FAILED_PRECONDITION). Keys not a multiple of 8 bytes:
  INVALID_ARGUMENT; more than --max_batch keys: RESOURCE_EXHAUSTED.
- `cube.v1.CubeService/SeekStream`: the same, many requests over one bidi stream, answered in
  order; a bad request ends the stream with its status (the message names its request_id).
- The TCP lane (`--tcp_lane`, default on; `cube.server.lane`): the same Seek bytes over plain
  length-prefixed TCP frames on each worker's own lane port (`--tcp_ports`, default any free
  port), announced as `cube-tcp-port` metadata on the answer to an empty unary Seek. ~10x
  cheaper per call than gRPC in Python; requests arriving in one event-loop turn share one
  kernel pass. The SDK uses it by default.
- `rec.mcube.DictService/seek`: the original API (one DictValue per key, miss = status
  0xFFFFFFFF with an empty value, version only when version_required).
- `rec.mcube.ControlService/cmd`: status, bg_load_base, bg_load_patch, enable, bg_switch,
  bg_unload, reload_base, reload_patch (see `cube.server.control`).
- `grpc.health.v1.Health` (SERVING once a version is current and the compiled kernel loaded:
  ready means fast, docs/reference/cube-server.md; NOT_SERVING before and while draining)
  and server reflection.

Data layout: `<data_dir>/VERSION` names the version served at start; `<data_dir>/<version>/`
holds index.cube + data.cube (with --dict_split D > 1: `<data_dir>/<split>/...` per split, key
-> split by --partitioner). A delta `<base>_<cur>` is layered over its base without copying;
its chain is `<version>/CHAIN` (one name per line, base first; written by the agent, or by the
server when it loads a patch without one), else rebuilt from the directory names. The server
never rewrites VERSION unless --write_version (the agent owns it).

Workers (`--workers N`): a supervisor process starts N workers; worker i serves port
`--worker_ports[i]` or `--port + i` (worker 0 = --port) and all map the same files. Clients
spread load by treating every worker port as a replica endpoint (status detail_json "ports"
lists them; cube.conf can list them too). `--reuseport` also binds every worker on the shared
--port (then the own ports default to --port + 1 + i).
Control commands are coordinated by worker 0 (others forward to it): loads are two-phase
(stage everywhere, then commit; any failure aborts the staged ones), switches are undone on
the workers that switched if one fails. A worker that dies stops the whole server (exit 1).
"""
