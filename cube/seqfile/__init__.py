"""Hadoop SequenceFiles, read and written: genuine Hadoop files (uncompressed, record- or
block-compressed, BytesWritable, LongWritable or Text keys) and the Cube tools' dialect. A
format of the core: cube-builder, kv_to_seqfile, kvtool and the transfer read or write it.
The format, the dialect and the bounds a hostile file meets: docs/ARCHITECTURE.md
(SequenceFiles). Modules: `base` (constants, errors, batches, vints), `limits`, `header`,
`records` (raw records of a chunk), `decode` (keys and values), `reader`, `writer`.
"""

from cube.seqfile import limits as limits
from cube.seqfile.base import (
    BLOCK_BYTES,
    BYTES_WRITABLE,
    COMPRESSIONS,
    CUBE_SYNC_INTERVAL,
    CURRENT_VERSION,
    DIALECTS,
    HADOOP_SYNC_INTERVAL,
    KEY_FORMATS,
    LONG_WRITABLE,
    MAGIC,
    SYNC_ESCAPE,
    SYNC_SIZE,
    TEXT,
    LocatedBatch,
    RecordBatch,
    SequenceFileError,
    SequenceFileHeader,
    ValueLocations,
    decode_vint,
    encode_text,
    encode_vint,
    vint_size,
)
from cube.seqfile.decode import concat_columns, decode_key
from cube.seqfile.header import encode_header, read_header
from cube.seqfile.limits import (
    MAX_BLOCK_BYTES,
    MAX_BLOCK_RECORDS,
    MAX_HEADER_TEXT_BYTES,
    MAX_METADATA_ENTRIES,
    MAX_RECORD_BYTES,
)
from cube.seqfile.reader import SequenceFileReader
from cube.seqfile.writer import SequenceFileWriter

__all__ = [
    "BLOCK_BYTES",
    "BYTES_WRITABLE",
    "COMPRESSIONS",
    "CUBE_SYNC_INTERVAL",
    "CURRENT_VERSION",
    "DIALECTS",
    "HADOOP_SYNC_INTERVAL",
    "KEY_FORMATS",
    "LONG_WRITABLE",
    "MAGIC",
    "MAX_BLOCK_BYTES",
    "MAX_BLOCK_RECORDS",
    "MAX_HEADER_TEXT_BYTES",
    "MAX_METADATA_ENTRIES",
    "MAX_RECORD_BYTES",
    "SYNC_ESCAPE",
    "SYNC_SIZE",
    "TEXT",
    "LocatedBatch",
    "RecordBatch",
    "SequenceFileError",
    "SequenceFileHeader",
    "SequenceFileReader",
    "SequenceFileWriter",
    "ValueLocations",
    "concat_columns",
    "decode_key",
    "decode_vint",
    "encode_header",
    "encode_text",
    "encode_vint",
    "read_header",
    "vint_size",
]
