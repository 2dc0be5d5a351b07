"""``pmaptap.Writer``: records from processes that are not part of the JAX job
(evaluation workers, data loaders), into the same run, without JAX (tests
import it with JAX made unimportable): a session's records (RecordBuilder)
through a session's sinks, with no thread (docs/api.md, "pmaptap.Writer").
"""

from __future__ import annotations

import functools
import os
import socket
import time
from typing import Any, Mapping

import numpy as np

from pmaptap._host.options import DEFAULTS
from pmaptap.errors import LockBusy, TapError, checked_number
from pmaptap.tapfile.record import (
    MAX_STEP,
    VALUE_KINDS,
    Record,
    check_step_range,
    check_text,
    encodable,
    is_narrow_int,
)

__all__ = ["Writer"]


# A Python number takes the dtype a traced tap gives it (x64 off), since a
# replicated value's hash covers its dtype (a float64 2.0 would be divergent
# from the job's float32 2.0); one that dtype cannot hold keeps 64 bits.
_PYTHON_NUMBER_DTYPES = {int: np.int32, float: np.float32, complex: np.complex64}
# While the file takes nothing, at most this many times max_buffer records
# are buffered (docs/api.md, "pmaptap.Writer").
MAX_BUFFERED = 16


def _python_number(x: Any) -> np.ndarray | None:
    dtype = _PYTHON_NUMBER_DTYPES.get(type(x))
    if dtype is None:  # bool is bool; NumPy scalars keep their own dtype
        return None
    if dtype is np.int32:
        info = np.iinfo(np.int32)
        return np.asarray(x, np.int32 if info.min <= x <= info.max else None)
    with np.errstate(over="ignore"):
        a = np.asarray(x, dtype)
    big = np.isinf(a).any() and not np.isinf(np.asarray(x)).any()
    return np.asarray(x) if big else a


def _leaf(x: Any, where: str) -> np.ndarray:
    a = _python_number(x)
    if a is None:
        a = np.asarray(x)
    dt = a.dtype
    if is_narrow_int(dt) and dt.name in ("int1", "uint1"):
        # As a tap refuses them (_trace/arguments.py: check_dtype): int1's 1
        # reads back as 1 in JAX and -1 in NumPy.
        raise TypeError(
            f"{where} has dtype {dt}; 1-bit integers cannot be written (JAX and "
            "NumPy disagree on their values). Convert it, e.g. x.astype(np.int8)."
        )
    if not encodable(dt):
        raise TypeError(
            f"a tap value must be numeric (NumPy arrays, scalars or "
            f"dicts/lists/tuples of them; bool, integer, int2/int4/uint2/uint4, "
            f"floating, bfloat16/float8 and complex dtypes), got "
            f"{type(x).__name__} of dtype {dt} at {where}"
        )
    if not dt.isnative:
        # Big-endian (or swapped) data: its values in this machine's order,
        # exactly, as a tap's arrays are. Written as given, its bytes would
        # be stored under a dtype name that does not say the order, and a
        # replicated value's hash would differ from the job's own.
        a = a.astype(dt.newbyteorder("="))
    return a


def _encode(value: Any, leaves: list[np.ndarray], where: str = "/") -> tuple[Any, Any, Any]:
    """(value, dtype, shape) with the pytree's nesting, as the session
    writes them; ``leaves`` collects the leaves, in the session's order, for
    the value hash. ``where``: the leaf's path, for errors."""
    from pmaptap._host.pipeline import encode_array
    from pmaptap.tapfile.source import stored_as_bytes

    if isinstance(value, Mapping):
        # Keys are written as text: two keys of one text (1 and "1") would
        # become one, and a value would be lost without a word.
        seen: dict[str, Any] = {}
        for k in value:
            other = seen.setdefault(str(k), k)
            if other is not k:
                raise ValueError(
                    f"the dict at {where} has keys {other!r} and {k!r}, both "
                    f"written as {str(k)!r}: one would be lost. Give them keys "
                    "that differ as text."
                )
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        enc = {str(k): _encode(v, leaves, f"{where.rstrip('/')}/{k}") for k, v in items}
        return tuple({k: e[i] for k, e in enc.items()} for i in range(3))
    if isinstance(value, (list, tuple)):
        enc = [_encode(v, leaves, f"{where.rstrip('/')}/{i}") for i, v in enumerate(value)]
        return tuple([e[i] for e in enc] for i in range(3))
    a = _leaf(value, where)
    if stored_as_bytes(a.nbytes, a.dtype):
        # Stored as bytes at the next flush: a copy, so that the caller's
        # array changing meanwhile cannot change what is written.
        a = a.copy()
    leaves.append(a)
    return encode_array(a)


def _is_id(x: Any) -> bool:
    """A process or device id as records hold it: an int in 0..2**63-1."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and 0 <= x <= MAX_STEP


class Writer:
    """Write tap records into a run from any process, JAX or not.

    path: the run's tap file as given to ``Session``, or an object-store URL.
    run: the run id (the JAX job's: e.g. passed on in ``PMAPTAP_RUN``).
    process: this writer's process number, unique in the run. processes: how
    many processes write the run (for ``layout="auto"``). docs/api.md,
    "pmaptap.Writer".
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        run: str,
        process: int,
        processes: int | None = None,
        layout: str = DEFAULTS.layout,
        host: str | None = None,
        flush_interval: float = DEFAULTS.writer_flush_interval,
        max_buffer: int = DEFAULTS.max_buffer,
        lock_timeout: float = DEFAULTS.lock_timeout,
        flush_timeout: float | None = DEFAULTS.flush_timeout,
    ) -> None:
        if not isinstance(run, str) or not run:
            raise ValueError(f"Writer: run must be a non-empty str, got {run!r}")
        check_text(run, f"Writer(run={run!r})", "run")
        check_text(host, f"Writer(host={host!r})", "host")
        if not _is_id(process):
            raise ValueError(
                f"Writer: process must be an int from 0 to 2**63-1, got "
                f"{type(process).__name__} {process!r}"
            )
        process = int(process)
        n = functools.partial(checked_number, "Writer")
        processes = n("processes", processes, integer=True, least=1, none=True)
        flush_interval = n("flush_interval", flush_interval)
        max_buffer = n("max_buffer", max_buffer, integer=True, least=1)
        lock_timeout = n("lock_timeout", lock_timeout)
        flush_timeout = n("flush_timeout", flush_timeout, none=True)
        from pmaptap._host.sinks import open_sink, write_target
        from pmaptap.tapfile.source import file_layout

        # The path resolved once, as a session's (an object-store URL: the
        # sharded layout, one PUT per batch gathered as a session's is;
        # flush() and close() still write at once).
        target = write_target("Writer", path, layout, flush_interval)
        layout = file_layout(target.layout, processes or 0)
        self.path = str(target.run)
        self.run, self.process, self.layout = run, process, layout
        self.host = host or socket.gethostname()
        from pmaptap._host.pipeline import RecordBuilder

        # The maker of this writer's records, with its identity (as a
        # session's pipeline has one).
        self._records = RecordBuilder(run, process, self.host)
        self.flush_interval = target.flush_interval
        self.max_buffer = max_buffer
        self.flush_timeout = flush_timeout
        self._sink: Any = open_sink(
            target.run,
            layout,
            process=process,
            lock_timeout=lock_timeout,
            lock=DEFAULTS.lock,
            index_existing=True,
        )
        self._buffer: list[Record] = []
        self._oldest = 0.0
        # Whether the last write failed (the file takes nothing: a full
        # disk), and what the writes replaced as unencodable since the last
        # flush() (said there).
        self._failing = False
        self._rejected: list[str] = []
        self.written = 0
        self.lock_busy = 0  # lock attempts that timed out (then retried)
        self.closed = False

    def __repr__(self) -> str:
        return (
            f"Writer(path={self.path!r}, run={self.run!r}, "
            f"process={self.process}, layout={self.layout!r})"
        )

    def write(
        self,
        name: str,
        step: int,
        value: Any,
        *,
        kind: str = "replicated",
        device: int | None = None,
    ) -> None:
        """Queue one record; written by the next flush (automatic by size
        and age, or ``flush()``/``close()``)."""
        if self.closed:
            raise TapError(f"write() on closed {self!r}", path=self.path)
        if not isinstance(name, str) or not name:
            raise ValueError(f"Writer.write: name must be a non-empty str, got {name!r}")
        check_text(name, f"Writer.write({name!r})")  # as a tap's
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool):
            raise ValueError(f"Writer.write({name!r}): step must be an int, got {step!r}")
        step = check_step_range(step, f"Writer.write({name!r})")  # as a tap's
        if kind not in VALUE_KINDS:
            raise ValueError(
                f"Writer.write({name!r}): kind must be one of {VALUE_KINDS}, got {kind!r}"
            )
        if kind == "replicated" and device is not None:
            raise ValueError(f"Writer.write({name!r}): device is for kind='per_device' only")
        if device is not None and not _is_id(device):
            # int(2.7) would write device 2, "3" a string id readers do not
            # match, 2**64 a line no encoder can write.
            raise ValueError(
                f"Writer.write({name!r}): device must be an int from 0 to "
                f"2**63-1 (the device's id), got {type(device).__name__} {device!r}"
            )
        leaves: list[np.ndarray] = []
        try:
            enc, dtype, shape = _encode(value, leaves)
        except (TypeError, ValueError) as e:
            raise type(e)(f"Writer.write({name!r}): {e}") from None
        except RecursionError:
            raise ValueError(
                f"Writer.write({name!r}): the value nests too deep to write "
                "(readers take 128 levels)"
            ) from None
        common = dict(name=name, step=step, kind=kind, value=enc, dtype=dtype, shape=shape)
        if kind == "replicated":
            from pmaptap._host.pipeline import value_key

            r = self._records.record(
                **common, replicas=1, processes=(self.process,), key=value_key(leaves)
            )
        else:
            r = self._records.record(
                **common, device=None if device is None else int(device), coords={}
            )
        if self._failing and len(self._buffer) >= MAX_BUFFERED * self.max_buffer:
            # The file has taken nothing for a while and the buffer is at
            # its bound: one more try, else refuse this record (not
            # buffered, so writing it again later adds no copy).
            try:
                self._write_buffer(timeout=0.0)
            except TapError as e:
                raise TapError(
                    f"{self!r}: {len(self._buffer)} records buffered and none "
                    f"written ({e.errors[0] if e.errors else e}); this record "
                    "was NOT buffered: write it again once flush() succeeds.",
                    path=self.path,
                    errors=e.errors,
                ) from e
        if not self._buffer:
            self._oldest = time.monotonic()
        self._buffer.append(r)
        if (
            len(self._buffer) >= self.max_buffer
            or time.monotonic() - self._oldest >= self.flush_interval
        ):
            try:
                self._write_buffer(timeout=0.0)
            except TapError:
                # The record is buffered: an error here would make a caller
                # that retries write() buffer it twice. The next flush() or
                # close() writes again and says it, as a session's does.
                pass

    def _write_buffer(self, timeout: float | None) -> None:
        """Write the buffer; retry a busy lock until ``timeout`` (0: one
        try). A TapError if it is not written, the records still buffered."""
        if not self._buffer:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                self._sink.write(self._buffer)
                break
            except LockBusy as e:
                self.lock_busy += 1
                if deadline is not None and time.monotonic() >= deadline:
                    # Also for a timeout of 0 (flush_timeout=0 too: its
                    # flush() and close() returned with nothing written).
                    raise TapError(
                        f"{self!r}: the lock stayed busy for "
                        f"{timeout:g} s ({e}); {len(self._buffer)} records "
                        "still buffered (flush() again)",
                        path=self.path,
                    ) from None
            except TapError:
                raise
            except Exception as e:  # noqa: BLE001 - disk full, EFBIG, a store's error
                # As a session reports its writer's failures: a TapError
                # naming the file and the cause; the batch was written whole
                # or not at all, and stays buffered for the next flush.
                self._failing = True
                raise TapError(
                    f"{self!r}: could not write {len(self._buffer)} buffered "
                    f"record(s): {type(e).__name__}: {e}. They stay buffered; "
                    "flush() again once the cause is fixed.",
                    path=self.path,
                    errors=(e,),
                ) from e
        self.written += len(self._buffer)
        self._buffer = []
        self._failing = False
        self._rejected += self._sink.rejected
        self._sink.rejected[:] = []

    def flush(self) -> None:
        """Write everything buffered (waits up to ``flush_timeout`` for the
        lock); a ``TapError`` if that fails, or if records were replaced as
        unencodable since the last flush (the automatic writes in
        ``write()`` leave their errors to this call)."""
        self._write_buffer(self.flush_timeout)
        rejected, self._rejected = self._rejected, []
        if rejected:
            raise TapError(
                f"{self!r}: {len(rejected)} record(s) could not be "
                f"encoded and were written as pmaptap/unencodable: "
                f"{'; '.join(rejected[:3])}",
                path=self.path,
            )

    def close(self) -> None:
        """Write everything buffered, then close. If that write fails (a
        full disk, a busy lock), the ``TapError`` is raised and the Writer
        stays open with its records buffered: ``close()`` (or ``flush()``)
        again once the cause is fixed writes them."""
        if self.closed:
            return
        try:
            self.flush()
        finally:
            # Records not written (an error raised): open, for close()
            # again; written (some perhaps as unencodable, raised): closed.
            if not self._buffer:
                self.closed = True
                self._sink.close()

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def pending(self) -> int:
        return len(self._buffer)

    @property
    def bytes_read(self) -> int:
        """Bytes of other processes' output read back (the one-file layout's
        dedup; 0 in the sharded layout)."""
        return self._sink.bytes_read
