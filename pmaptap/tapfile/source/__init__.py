"""Where a run's records are: a path resolved once into a ``Run`` (run.py),
its lines as one stream (lines.py), an object store's chunks (store.py)
and array values stored as bytes (arrays.py). The layer's one entry."""

from pmaptap.tapfile import loaded_on_use
from pmaptap.tapfile.source.arrays import (
    BYTES_SUFFIX,
    INLINE_MAX_BYTES,
    ByteStore,
    byte_leaves,
    bytes_dir,
    field_problem,
    load_value,
    npy_chunks,
    npy_header,
    numpy_dtype,
    run_root,
    shown_value,
    stored_as_bytes,
)
from pmaptap.tapfile.source.lines import (
    collector_paused,
    iter_file_records,
    iter_lines,
    iter_record_batches,
    parsed,
    read_block,
    records,
)
from pmaptap.tapfile.source.run import (
    FILE_LAYOUTS,
    Run,
    SourceLine,
    base_and_directory,
    copy_key,
    file_layout,
    is_url,
    merge_keys,
    owner,
    shard_dir,
    shard_path,
    shard_process,
    source_problem,
    sources,
)
from pmaptap.tapfile.source.store import (
    SHARD_SUFFIX,
    Cursor,
    Object,
    Reader,
    chunk_name,
    fetch,
    piece_bytes,
    rollup_name,
    url_fs,
)

# Limits and the object-store listing, read at each use from their module:
# the module keeps the one value (set there, in a test, it holds for all).
_LIVE = {
    "FETCH_THREADS": "run",
    "SHARDED_ABOVE": "run",
    "ROLLUP_BYTES": "store",
    "ROLLUP_CHUNKS": "store",
    "objects": "store",
    "objects_after": "store",
}


__getattr__ = loaded_on_use(__name__, _LIVE, attribute=True)
