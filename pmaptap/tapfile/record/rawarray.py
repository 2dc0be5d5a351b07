"""A leaf on its way to be stored as bytes (tapfile/source/arrays.py says how they
are stored and read): the aggregator wraps the array, the writer stores its
bytes and the record's line then points at them. Imports nothing of
pmaptap's, so the record type (format.py) can hold one."""

from __future__ import annotations

from typing import Any, Iterator


class RawArray:
    """A leaf travelling to the writer as its NumPy array (C order). The
    sink stores its bytes and sets ``ref`` once (a retried batch does not
    write them again). ``header``: its ``.npy`` header, if already made."""

    __slots__ = ("array", "ref", "header")

    def __init__(self, array: Any, header: bytes | None = None) -> None:
        self.array = array
        self.ref: dict | None = None
        self.header = header

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def __repr__(self) -> str:
        a = self.array
        return f"RawArray({a.dtype.name}{list(a.shape)})"


def has_raw(value: Any, dtype: Any) -> bool:
    """Does a record's value (as the aggregator built it) hold a RawArray?"""
    return next(raw_leaves(value, dtype), None) is not None


def raw_leaves(value: Any, dtype: Any) -> Iterator[RawArray]:
    """The RawArray leaves of a value, found by ``dtype``'s nesting (never
    walking into an inline leaf)."""
    if type(value) is RawArray:
        yield value
    elif isinstance(dtype, dict) and isinstance(value, dict):
        for k, d in dtype.items():
            yield from raw_leaves(value.get(k), d)
    elif isinstance(dtype, list) and isinstance(value, list):
        for v, d in zip(value, dtype):
            yield from raw_leaves(v, d)


def split_raw(value: Any, dtype: Any) -> tuple[Any, Any]:
    """(value with null at each stored leaf, the ``bytes`` field) of a value
    whose RawArray leaves have been stored (their ``ref`` set)."""
    if type(value) is RawArray:
        if value.ref is None:
            raise ValueError(f"{value!r} was not stored before its line was encoded")
        return None, value.ref
    if isinstance(dtype, dict) and isinstance(value, dict):
        pairs = {k: split_raw(v, dtype.get(k)) for k, v in value.items()}
        return {k: p[0] for k, p in pairs.items()}, {k: p[1] for k, p in pairs.items()}
    if isinstance(dtype, list) and isinstance(value, list):
        pairs = [split_raw(v, d) for v, d in zip(value, dtype)]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    return value, None
