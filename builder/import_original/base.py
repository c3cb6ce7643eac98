"""What the cube-import modules share: exit codes, the key format the headers name, the
version and part-name patterns, the error, warnings.
"""

from __future__ import annotations

import re
import signal
import sys

from cube.original_format import (
    DATA_LIST,
    INDEX_LIST,
    numbered_file,
)

EXIT_OK, EXIT_FAILED, EXIT_BAD_FLAGS = 0, 1, 2
# What the headers say the keys were read as: the original read a record's key as its raw 8
# bytes, little-endian (builder_job.cpp), cube-builder's "cube" key format.
KEY_FORMAT = "cube"
FORMAT_FILES = "data.N, index.N, data.n, index.n"  # the original's shard files, for messages
_VERSION_RE = re.compile(r"(0|[1-9][0-9]{0,18})(?:_(0|[1-9][0-9]{0,18}))?")
_VERSION_RULE = "<depend>_<cur> or <depend>, positive numbers without leading zeros"
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class ImportError_(RuntimeError):
    """An import that cannot go on; the message is one line for the user."""


def warn(message: str) -> None:
    """A warning: stderr, always (-quiet silences the summary only)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def is_original_file(name: str) -> bool:
    """A file of the original's shards: index.n, data.n, index.N or data.N."""
    return name in (INDEX_LIST, DATA_LIST) or numbered_file(name) is not None
