"""The sharded layout on an object store (``s3://``, ``gs://``, any fsspec
URL): each process writes immutable chunks.

Object stores have no append and no lock, and an object is written whole or
not at all. So a process never shares or changes an object: every batch the
writer thread hands over (it lingers ``OBJECT_COMMIT_INTERVAL`` seconds to
gather one, and ``flush()``/``close()`` cut that short) becomes one new
object ``<url>.d/p<process>-<writer id>-<seq>.jsonl``. A process killed
mid-run leaves the chunks it committed, whole; the upload in flight never
appears; there is no lock or marker to clean up. The writer id (start time
and a random token) keeps a restarted process from overwriting its earlier
chunks, and sorts after them. Readers list ``<url>.d/`` and merge
(``pmaptap/tapfile/runs.py``). Endpoint and credentials come from the
client's own standard environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ... for s3fs; gcsfs's for ``gs://``).
"""

from __future__ import annotations

import secrets
import time
from typing import Sequence

from pmaptap._host.blobs import object_blob
from pmaptap._host.dirsink import DirectorySink
from pmaptap._host.sink import FileSink, Sink
from pmaptap.errors import TapPathError
from pmaptap.tapfile import runs
from pmaptap.tapfile.arrays import BYTES_SUFFIX
from pmaptap.tapfile.format import Record
from pmaptap.tapfile.rawarray import RawArray

# Seconds the writer thread gathers records into one chunk (one PUT).
OBJECT_COMMIT_INTERVAL = 2.0


class ObjectSink(Sink):
    def __init__(self, url: str, *, process: int | None = None) -> None:
        if process is None:
            import jax

            process = jax.process_index()
        self.process = int(process)
        self.path = url
        self.fs, self.prefix = runs.url_fs(url)
        self.directory = self.prefix + runs.SHARD_SUFFIX
        # Stored values (tapfile/arrays.py): objects under <prefix>.bytes/,
        # named in lines relative to the prefix's parent.
        self.bytes_prefix = self.prefix + BYTES_SUFFIX
        self.bytes_rel = self.prefix.rsplit("/", 1)[-1] + BYTES_SUFFIX
        self.blob_bytes_written = 0
        self.writer_id = f"{int(time.time() * 1000):013d}-{secrets.token_hex(3)}"
        self.seq = 0
        self.lines_written = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.skipped = 0
        self.rejected: list[str] = []
        try:
            # Reachable and writable now, not at the first batch: an empty
            # first chunk is cheap and says so at Session.open().
            self._put(b"")
        except Exception as e:  # noqa: BLE001 - any client error
            raise TapPathError(
                f"cannot write to {url!r}: {type(e).__name__}: {e}. "
                "Check the bucket, the credentials and the "
                "endpoint (e.g. AWS_ENDPOINT_URL).",
                path=url,
            ) from e

    _encode = FileSink._encode

    def _put(self, data: bytes) -> None:
        name = f"{self.directory}/p{self.process:05d}-{self.writer_id}-{self.seq:09d}.jsonl"
        self.fs.pipe_file(name, data)
        self.seq += 1

    def _store_raws(self, raws: Sequence[RawArray]) -> None:
        """The batch's stored values as ONE new object
        ``<url>.bytes/p<process>-<writer id>-<seq>.bin``, put before the
        chunk of lines that points at it (a crash in between leaves an
        object nobody points at); references set only once it is there."""
        if not raws:
            return
        base = f"p{self.process:05d}-{self.writer_id}-{self.seq:09d}.bin"
        data, refs = object_blob(raws, f"{self.bytes_rel}/{base}")
        self.fs.pipe_file(f"{self.bytes_prefix}/{base}", data)
        for raw, ref in zip(raws, refs):
            raw.ref = ref
        self.blob_bytes_written += len(data)

    own_lines = DirectorySink.own_lines

    def write(self, records: Sequence[Record]) -> list[Record]:
        keep, chunks = self.own_lines(records)
        if not keep:
            return []
        data = b"".join(chunks)
        self._put(data)  # raises: the pipeline retries the batch whole
        self.lines_written += len(keep)
        self.bytes_written += len(data)
        return keep  # what was written: the session's forwarders get these
