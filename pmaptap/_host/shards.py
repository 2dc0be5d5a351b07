"""Host side of per-shard taps (layout "shards", see _trace/shardcall.py):
per-shard statistics for ``max_value_bytes`` and the records of one step's
shards, slice by slice.

Dedup of shards: ``per_device`` writes every shard that arrived. ``auto`` and
``replicated`` compare the copies of each slice (devices holding the same
``index``, a value replicated along some mesh axes): agreeing copies make
one record for the slice whose ``devices`` are all its holders in the job
(every process holding the slice writes the same record; the file-level
dedup keeps one); a slice with a single holder under ``auto`` is a
per-device record. Disagreeing copies are written as for mapped axes:
``auto`` one per-device record each, ``replicated`` one record per distinct
value with ``divergent`` and its ``holders``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from pmaptap.tapfile.format import COUNT_BASE


def host_statistics(a: np.ndarray, batch_dims: int = 0) -> np.ndarray:
    """NumPy twin of ``stats.device_statistics`` over the trailing (unbatched) axes of
    one shard: float32[..., 8] (min, max, mean, std over finite elements,
    then NaN and inf counts split in two float32 each)."""
    import ml_dtypes  # noqa: F401 - bfloat16/float8 arrive as such

    lead = a.shape[:batch_dims]
    flat = a.reshape(lead + (-1,))
    if np.iscomplexobj(flat):
        nan = np.isnan(flat.real) | np.isnan(flat.imag)
        inf = np.isinf(flat.real) | np.isinf(flat.imag)
        xf = np.abs(flat).astype(np.float32)
        finite = ~(nan | inf)
    elif flat.dtype.kind == "f" or "float" in flat.dtype.name:
        xf = flat.astype(np.float32)
        nan, inf = np.isnan(xf), np.isinf(xf)
        finite = ~(nan | inf)
    else:
        xf = flat.astype(np.float32)
        nan = inf = np.zeros(flat.shape, bool)
        finite = np.ones(flat.shape, bool)
    n = finite.sum(-1)
    denom = np.maximum(n, 1).astype(np.float32)
    mean = np.where(finite, xf, 0).sum(-1, dtype=np.float32) / denom
    std = np.sqrt(
        np.where(finite, np.square(xf - mean[..., None]), 0).sum(-1, dtype=np.float32) / denom
    )
    with np.errstate(invalid="ignore"):
        lo = np.where(finite, xf, np.inf).min(-1) if xf.shape[-1] else np.full(lead, np.inf)
        hi = np.where(finite, xf, -np.inf).max(-1) if xf.shape[-1] else np.full(lead, -np.inf)
    none = n == 0
    stats = [np.where(none, np.nan, v).astype(np.float32) for v in (lo, hi, mean, std)]
    for count in (nan.sum(-1), inf.sum(-1)):
        stats += [(count // COUNT_BASE).astype(np.float32), (count % COUNT_BASE).astype(np.float32)]
    return np.stack(stats, -1)


def statistics_of_leaves(site: Any, leaves: list[np.ndarray]) -> tuple[list[np.ndarray], tuple]:
    """Statistics in place of the leaves ``site.as_statistics`` (a TapSite) marks,
    and the tuple marking them in the same form (dtype, this shard's unbatched
    shape)."""
    if not site.as_statistics:
        return leaves, ()
    out, marks = [], []
    for a, mark in zip(leaves, site.as_statistics):
        if mark is None:
            out.append(a)
            marks.append(None)
        else:
            out.append(host_statistics(a, site.batch_dims))
            marks.append((mark[0], tuple(a.shape[site.batch_dims :])))
    return out, tuple(marks)


def by_slice(copies: list) -> "OrderedDict[Any, list]":
    """Copies by the slice they hold (their ``index``), in partition
    order; unknown slices (None) go together."""
    out: OrderedDict[Any, list] = OrderedDict()
    for cp in sorted(copies, key=lambda c: c.partition):
        out.setdefault(cp.slice_key, []).append(cp)
    return out
