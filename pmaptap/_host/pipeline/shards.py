"""Host side of per-shard taps (layout "shards", see _trace/shardcall.py):
a shard's leaves (``shard_leaves``; its statistics for ``max_value_bytes``,
computed on its device, _trace/shardstats.py) and one step's shards grouped
by the slice they hold (``by_slice``). The aggregator makes the records and
deduplicates the shards (``Aggregator._resolve_shards``) by the rules of
docs/api.md, "Sharded values under jit".
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from pmaptap._common.shard_placement import read_statistics_rows


def shard_leaves(
    site: Any, place: Any, k: int, arrays: list[np.ndarray]
) -> tuple[list, tuple, Any]:
    """Partition ``k``'s leaves as the record writes them: its shards
    without XLA's padding, and in place of each leaf ``site.as_statistics``
    (a TapSite) marks, the statistics its device computed (a row of the
    table that travelled instead, _common/shard_placement.py). Returns
    (leaves, the marks in TapSite.as_statistics's form with this shard's
    unbatched shape, the record's index)."""
    marks = site.as_statistics
    summary = tuple(bool(m) for m in marks) if marks else ()
    leaves = place.crop(k, arrays, skip=summary)
    if not marks:
        return leaves, (), place.index_of(k, leaves)
    out, made = [], []
    for j, (a, mark) in enumerate(zip(leaves, marks)):
        if mark is None:
            out.append(a)
            made.append(None)
            continue
        _, rows = read_statistics_rows(a, site.batch_dims)
        if place.devices[k] not in rows:
            raise ValueError(
                f"pmaptap.tap({site.name!r}): the statistics of partition {k} came "
                f"without a row of its device {place.devices[k]} (devices "
                f"{sorted(rows)}): the shard's statistics are not known."
            )
        index, stats = rows[place.devices[k]]
        known = index if index is not None or place.slices[j] is None else place.slices[j][k]
        shape = place.shapes[j] if known is None else tuple(b - a for a, b in known)
        out.append(stats)
        made.append((mark[0], tuple(shape[site.batch_dims :])))
    return out, tuple(made), place.index_of(k, leaves, skip=summary)


def by_slice(copies: list) -> "OrderedDict[Any, list]":
    """Copies by the slice they hold (their ``index``), in partition
    order; unknown slices (None) go together."""
    out: OrderedDict[Any, list] = OrderedDict()
    for cp in sorted(copies, key=lambda c: c.partition):
        out.setdefault(cp.slice_key, []).append(cp)
    return out
