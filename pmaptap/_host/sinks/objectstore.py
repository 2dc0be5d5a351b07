"""The sharded layout on an object store (``s3://``, ``gs://``, any fsspec
URL): each process writes immutable chunks, rolled up now and then (why,
names, rollups and what readers do: docs/multihost.md, "Object stores";
tapfile/source/store.py). Endpoint and credentials come from the client's
own environment (``AWS_ENDPOINT_URL``, ... for s3fs; gcsfs's for ``gs://``).
"""

from __future__ import annotations

import threading
from typing import Sequence

from pmaptap import distributed
from pmaptap._host.sinks.blobs import new_writer_id, object_blob
from pmaptap._host.sinks.directory import Held, ShardSink
from pmaptap._log import log
from pmaptap.errors import TapPathError
from pmaptap.tapfile import source
from pmaptap.tapfile.record import RawArray, Record
from pmaptap.tapfile.source import BYTES_SUFFIX

# Seconds the writer thread gathers records into one chunk (one PUT).
OBJECT_COMMIT_INTERVAL = 2.0


class ObjectSink(ShardSink):
    def __init__(self, url: str, *, process: int | None = None) -> None:
        self.process = distributed.process_index(process)
        self.path = url
        self.fs, self.prefix = source.url_fs(url)
        self.directory = self.prefix + source.SHARD_SUFFIX
        # Stored values (tapfile/source/arrays.py): objects under <prefix>.bytes/,
        # named in lines relative to the prefix's parent.
        self.bytes_prefix = self.prefix + BYTES_SUFFIX
        self.bytes_rel = self.prefix.rsplit("/", 1)[-1] + BYTES_SUFFIX
        self.writer_id = new_writer_id()
        self.seq = 0
        # The chunks put since the last rollup, (name, bytes) (the last
        # len(window) seqs, the last window_bytes of this writer's
        # stream_bytes).
        self._window: list[tuple[str, bytes]] = []
        self._window_bytes = 0
        self._stream_bytes = 0
        self._unsure: bytes | None = None  # the bytes of a PUT that failed
        self._done = b""  # of a batch whose PUT failed, the bytes put since
        # close() may run while the writer thread's PUT is still under way
        # (Pipeline.close stops waiting for it after 5 s): one at a time.
        self._lock = threading.RLock()
        self.lines_written = 0
        self.bytes_read = 0
        self.skipped = 0
        self.held = Held()  # replicated values left to their owners (directory.py)
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

    def _put(self, data: bytes) -> None:
        """``data`` as the next chunk. After a PUT that failed (it may have
        landed all the same: a lost response), the retry puts exactly the
        bytes it tried under that name again and the records gathered since
        as the next chunk: a name once put never changes (a follower may
        have read it; the rollup's offsets count its bytes)."""
        with self._lock:
            # What of this batch an earlier try put for sure (it is retried
            # whole): not put again.
            done = self._done
            if done and data.startswith(done):
                data = data[len(done) :]
            else:
                self._done = done = b""
            unsure = self._unsure
            if unsure and len(data) > len(unsure) and data.startswith(unsure):
                self._put_chunk(unsure)
                self._done = done = done + unsure
                data = data[len(unsure) :]
            self._put_chunk(data)
            self._done = b""

    def _put_chunk(self, data: bytes) -> None:
        name = source.chunk_name(
            self.directory, self.process, self.writer_id, self.seq, self._stream_bytes
        )
        try:
            self.fs.pipe_file(name, data)
        except BaseException:
            self._unsure = data
            raise
        self._unsure = None
        self._window.append((name, data))
        self._window_bytes += len(data)
        self._stream_bytes += len(data)
        self.seq += 1
        if len(self._window) >= source.ROLLUP_CHUNKS or self._window_bytes >= source.ROLLUP_BYTES:
            self._roll_up()

    def _roll_up(self) -> None:
        """Put the window's chunks as one object, then delete them. Only
        an optimization: on any failure the chunks stay (readers skip those
        a listed rollup covers), so nothing is lost or read twice."""
        window, start = self._window, self._stream_bytes - self._window_bytes
        self._window, self._window_bytes = [], 0
        if sum(1 for _, d in window if d) < 2:
            return  # one object already (an empty chunk costs no fetch)
        first, last = self.seq - len(window), self.seq - 1
        name = source.rollup_name(self.directory, self.process, self.writer_id, first, last, start)
        try:
            self.fs.pipe_file(name, b"".join(d for _, d in window))
        except Exception as e:  # noqa: BLE001 - any client error; the chunks stay
            log.warning("pmaptap: could not roll up chunks %d-%d into %s: %s", first, last, name, e)
            return
        try:
            self.fs.rm([n for n, _ in window])  # the names they were put under
        except Exception as e:  # noqa: BLE001 - readers skip chunks the rollup covers
            log.warning("pmaptap: could not delete chunks %d-%d after %s: %s", first, last, name, e)

    def close(self) -> None:
        with self._lock:
            self._roll_up()

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

    def _append_lines(self, keep: list[Record], chunks: list[bytes]) -> None:
        data = b"".join(chunks)
        self._put(data)  # raises: the pipeline retries the batch whole
        self.lines_written += len(keep)
