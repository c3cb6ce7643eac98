"""cube-import: tables the original Cube built (data.N, index.N, data.n, index.n per shard),
converted into this project's format, base and patches, by the builder's own writer and packer.
A thin shell over `cube.original_format` (the format, its checks, the values), in four steps:
`discover` (the original's files in each input), `files` (one source opened and mapped), `plan`
(versions in families, in order), `write` (converted, staged, published at once); `command` is
the CLI. Usage: `cube-import --help`, docs/MIGRATION.md (section 5); how it bounds memory and
never publishes half an import: docs/ARCHITECTURE.md (cube-import).
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as cube-builder: no BLAS threads needed

from cube.builder.import_original.command import main, run

__all__ = ["main", "run"]
