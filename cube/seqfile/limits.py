"""The most a SequenceFile may state, checked before anything is allocated for it: far above
what Hadoop or the Cube tools write (class names are < 100 bytes, values are embeddings
(KB), blocks ~1 MB), so only a hostile or damaged file meets them. Read at call time
(`limits.MAX_RECORD_BYTES`), so that a caller (or a test) may lower them.
"""

from __future__ import annotations

MAX_HEADER_TEXT_BYTES = 4 << 20  # one class name, codec name or metadata key/value
MAX_METADATA_ENTRIES = 1 << 16
MAX_RECORD_BYTES = 256 << 20  # one record (key + value), and one decompressed value
MAX_BLOCK_RECORDS = 1 << 22  # records in one compressed block (~40 bytes of index each)
MAX_BLOCK_BYTES = 1 << 30  # a block's keys + values, decompressed (compressed: twice that)
