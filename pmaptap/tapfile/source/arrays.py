"""Array values stored as bytes beside the tap file (the ``bytes`` field;
docs/api.md, "Array values: stored as bytes"). NumPy loads only where a
value is loaded."""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Iterator

from pmaptap.errors import MissingBytes
from pmaptap.tapfile.record import RawArray, is_ref
from pmaptap.tapfile.source.run import is_url

# Leaves of more bytes than this are stored as bytes (docs/performance.md).
INLINE_MAX_BYTES = 1024


def stored_as_bytes(nbytes: int, dtype: Any) -> bool:
    """Above INLINE_MAX_BYTES, or where doubles cannot hold the values
    exactly (float128 and complex256 on x86)."""
    return nbytes > INLINE_MAX_BYTES or (
        (dtype.kind == "f" and dtype.itemsize > 8) or (dtype.kind == "c" and dtype.itemsize > 16)
    )


# The directory beside a tap file that holds its writers' byte files.
BYTES_SUFFIX = ".bytes"

# ml_dtypes' types are not NumPy's own: their .npy descr ("<V2", "<f1") is
# one NumPy cannot read back. Written as the unsigned integer of the same
# width, so that NumPy alone reads their bits.
_UINT_OF_WIDTH = {1: "|u1", 2: "<u2", 4: "<u4", 8: "<u8"}


class Stored:
    """A stored leaf where a reader shows a value without loading it
    (``pmaptap show``, the console): ``<float32[256,256] as bytes>``."""

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: Any, shape: Any) -> None:
        self.dtype, self.shape = dtype, shape

    def __str__(self) -> str:
        dims = ",".join(map(str, self.shape)) if isinstance(self.shape, list) else "?"
        return f"<{self.dtype}[{dims}] as bytes>"

    __repr__ = __str__


def shown_value(value: Any, dtype: Any, shape: Any, field: Any = None, store: Any = None) -> Any:
    """``value`` with a ``Stored`` at each leaf stored as bytes (a reference
    in ``field``, the ``bytes`` field, or a writer's RawArray), or with
    ``store``, that leaf loaded; walked by ``dtype``'s nesting (a field of
    another nesting, a hostile line's, stores nothing)."""
    if type(value) is RawArray or is_ref(field):
        if store is not None:
            return store.load_leaf(field, dtype, shape)
        return Stored(dtype, shape) if type(value) is RawArray or value is None else value
    if isinstance(dtype, dict) and isinstance(value, dict):
        shapes = shape if isinstance(shape, dict) else {}
        f = field if isinstance(field, dict) else {}
        return {
            k: shown_value(v, dtype.get(k), shapes.get(k), f.get(k), store)
            for k, v in value.items()
        }
    if isinstance(dtype, list) and isinstance(value, list):
        shapes = shape if isinstance(shape, list) else [None] * len(value)
        f = field if isinstance(field, list) else [None] * len(value)
        return [shown_value(*x, store) for x in zip(value, dtype, shapes, f)]
    return value


@functools.cache  # a step's shards mostly share one
def npy_header(dtype: Any, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` format 1.0 header of a C-order array."""
    import io

    import numpy as np

    # isbuiltin 2: a user-defined type (ml_dtypes): its bits (_UINT_OF_WIDTH).
    descr = _UINT_OF_WIDTH[dtype.itemsize] if dtype.isbuiltin == 2 else dtype.str
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": descr, "fortran_order": False, "shape": tuple(shape)}
    )
    return buf.getvalue()


def npy_chunks(raw: RawArray) -> list:
    """The ``.npy`` of one leaf as buffers for writev (no copy of the
    array's bytes: a view of the buffer the callback handed over)."""
    a = raw.array
    body = memoryview(a.reshape(-1).view("u1")) if a.size else b""
    return [raw.header or npy_header(a.dtype, a.shape), body]


def byte_leaves(field: Any, dtype: Any, shape: Any, path: str = "") -> Iterator[tuple]:
    """(path ``/key/0/...``, reference, dtype, shape) of each stored leaf."""
    if is_ref(field):
        yield path, field, dtype, shape
    elif isinstance(field, dict) and isinstance(dtype, dict):
        shapes = shape if isinstance(shape, dict) else {}
        for k, f in field.items():
            yield from byte_leaves(f, dtype.get(k), shapes.get(k), f"{path}/{k}")
    elif isinstance(field, list) and isinstance(dtype, list):
        shapes = shape if isinstance(shape, list) else [None] * len(field)
        for i, (f, d, s) in enumerate(zip(field, dtype, shapes)):
            yield from byte_leaves(f, d, s, f"{path}/{i}")


def field_problem(d: dict) -> str | None:
    """What is wrong with a record's ``bytes`` field as written, or None."""
    if "bytes" not in d:
        return None
    field, dtype, shape, value = d["bytes"], d.get("dtype"), d.get("shape"), d.get("value")

    def walk(f: Any, dt: Any, v: Any) -> str | None:
        if f is None:
            return None
        if isinstance(dt, str):
            if not is_ref(f):
                return "bytes must be {file, offset, nbytes} (or null) at each leaf"
            if v is not None:
                return "a leaf stored as bytes has value null"
            if os.path.isabs(f["file"]) or ".." in f["file"].split("/"):
                return "bytes.file must be a path inside the run's directory"
            return None
        if isinstance(dt, dict) and isinstance(f, dict) and isinstance(v, dict):
            if not set(f) <= set(dt):
                return "bytes and dtype do not have the same keys"
            parts: Any = ((f[k], dt[k], v.get(k)) for k in f)
        elif isinstance(dt, list) and isinstance(f, list) and isinstance(v, list):
            if len(f) != len(dt):
                return "bytes and dtype do not have the same length"
            parts = zip(f, dt, v)
        else:
            return "bytes does not have the nesting of dtype"
        return next(filter(None, (walk(*p) for p in parts)), None)

    problem = walk(field, dtype, value)
    if problem is None and not any(True for _ in byte_leaves(field, dtype, shape)):
        return "bytes holds no reference"
    return problem


def run_root(path: str | os.PathLike) -> str:
    """The directory (or URL prefix) ``bytes.file`` is relative to."""
    p = os.fspath(path)
    if is_url(p):
        return p.rstrip("/").rsplit("/", 1)[0]
    p = os.path.abspath(p)
    if p.endswith(".d") and os.path.isdir(p):
        p = p[:-2]
    return os.path.dirname(p)


def bytes_dir(path: str | os.PathLike) -> str:
    """Where the writers of the run at ``path`` put their byte files."""
    p = os.fspath(path)
    return (p.rstrip("/") if is_url(p) else os.path.abspath(p)) + BYTES_SUFFIX


class ByteStore:
    """Reads a run's stored leaves; sizes cached: a stat per file."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.root = run_root(path)
        self.url = is_url(self.root)
        self._sizes: dict[str, int | None] = {}

    @functools.cached_property
    def _fs(self) -> Any:
        from pmaptap.tapfile.source.store import url_fs

        return url_fs(self.root)[0]

    def _where(self, ref: dict) -> str:
        name = ref["file"]
        if name.startswith("/") or "\\" in name or ".." in name.split("/"):
            # A tap file is data: its references never reach outside the
            # run's directory.
            raise MissingBytes(f"its bytes' file {name!r} is not inside the run's directory")
        if self.url:
            return self.root + "/" + ref["file"]
        return os.path.join(self.root, *ref["file"].split("/"))

    def _size(self, where: str) -> int | None:
        if where not in self._sizes:
            try:
                size = int(self._fs.size(where)) if self.url else os.stat(where).st_size
            except OSError:
                size = None
            self._sizes[where] = size
        return self._sizes[where]

    def missing_problem(self, ref: dict) -> str | None:
        """Why ``ref``'s bytes cannot be read, or None (a size is stat'ed
        again when a reference reaches past it: a live run's file grows)."""
        try:
            where = self._where(ref)
        except MissingBytes as e:
            return str(e)
        size = self._size(where)
        end = ref["offset"] + ref["nbytes"]
        if size is not None and size < end:
            self._sizes.pop(where, None)
            size = self._size(where)
        if size is None:
            return f"its bytes' file {ref['file']!r} is missing"
        if size < end:
            return (
                f"its bytes {ref['file']!r} [{ref['offset']}, {end}) are past the end "
                f"of that file ({size} bytes): the writer was killed, or the file cut"
            )
        return None

    def read_ref(self, ref: dict) -> bytes:
        """The bytes ``ref`` names, checked against the file's size before
        anything is allocated (``nbytes: 2**62`` is no MemoryError)."""
        where = self._where(ref)
        start, end = ref["offset"], ref["offset"] + ref["nbytes"]
        if self.url:
            try:
                data = bytearray(self._fs.cat_file(where, start=start, end=end))
            except (OSError, ValueError, OverflowError) as e:
                self._sizes.pop(where, None)
                raise MissingBytes(self.missing_problem(ref) or str(e)) from None
        else:
            problem = self.missing_problem(ref)
            if problem is not None:
                raise MissingBytes(problem)
            data = bytearray(end - start)  # writable: the array read() returns
            try:
                with open(where, "rb") as f:
                    f.seek(start)
                    n = f.readinto(data)
            except OSError as e:
                self._sizes.pop(where, None)
                raise MissingBytes(self.missing_problem(ref) or str(e)) from None
            if n != len(data):
                del data[n:]
        if len(data) != end - start:
            raise MissingBytes(self.missing_problem(ref) or "its bytes are cut short")
        return data

    def load_leaf(self, ref: dict, dtype: str, shape: Any) -> Any:
        """The stored leaf as an ndarray of its ``dtype`` and ``shape``, or
        MissingBytes."""
        problem = npy_size_problem(ref["nbytes"], dtype, shape)
        if problem is not None:
            raise MissingBytes(problem)
        return decode_npy(self.read_ref(ref), dtype, shape)


# A .npy (format 1.0) header: the 10-byte preamble and a header of at most
# 65,535 bytes.
_NPY_HEADER_MAX = 10 + 0xFFFF


def npy_size_problem(nbytes: int, dtype: str, shape: Any) -> str | None:
    """Why ``nbytes`` cannot be the ``.npy`` of a ``dtype``/``shape`` leaf."""
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        return f"its shape {shape!r} is not a list of sizes"
    data = numpy_dtype(dtype).itemsize * math.prod(shape)
    if not data < nbytes <= data + _NPY_HEADER_MAX:
        return (
            f"its bytes are {nbytes} long, not the .npy of a {dtype}{shape} "
            f"({data} data bytes and a header)"
        )
    return None


def numpy_dtype(name: Any) -> Any:
    """The NumPy dtype of a record's leaf ``dtype`` name, one the format holds
    (format.encodable) and nothing else: bytes are never read as objects."""
    import numpy as np

    from pmaptap.tapfile.record import encodable

    try:
        dt = np.dtype(name)
    except TypeError:
        try:
            import ml_dtypes
        except ImportError:  # pragma: no cover - ml_dtypes comes with jax
            raise MissingBytes(
                f"dtype {name!r} needs the ml_dtypes package (pip install ml_dtypes)"
            ) from None
        t = getattr(ml_dtypes, name, None) if isinstance(name, str) else None
        if t is None:
            raise MissingBytes(f"dtype {name!r} is not one a record holds") from None
        dt = np.dtype(t)
    if not isinstance(name, str) or not encodable(dt) or dt.name != name:
        raise MissingBytes(f"dtype {name!r} is not one a record holds")
    return dt


def decode_npy(data: bytes | bytearray, dtype: str, shape: Any) -> Any:
    """One ``.npy`` -> the array of the record's dtype and shape, or MissingBytes."""
    import io

    import numpy as np

    f = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(f)
        if version != (1, 0):
            raise ValueError(f".npy version {version}")
        got_shape, fortran, got = np.lib.format.read_array_header_1_0(f)
    except ValueError as e:
        raise MissingBytes(f"its bytes are not a .npy array ({e})") from None
    dt = numpy_dtype(dtype)
    if fortran or list(got_shape) != list(shape) or got.itemsize != dt.itemsize:
        raise MissingBytes(
            f"its bytes hold {got}{list(got_shape)}, not the line's {dtype}{list(shape)}"
        )
    start = f.tell()
    n = dt.itemsize * math.prod(got_shape)
    if len(data) - start != n:
        raise MissingBytes(f"its bytes hold {len(data) - start} data bytes, not {n}")
    array = np.frombuffer(data, dtype=dt, count=n // dt.itemsize if n else 0, offset=start)
    return array.reshape(got_shape)


def load_value(d: dict, store: ByteStore) -> Any:
    """A decoded record's value with every stored leaf loaded."""
    return shown_value(d.get("value"), d.get("dtype"), d.get("shape"), d.get("bytes"), store)
