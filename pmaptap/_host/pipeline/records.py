"""The third stage of the aggregation path (payload.py -> aggregate.py ->
here -> encode.py): ``RecordBuilder``, the one maker of the records a
writer writes, made once per pipeline (and per ``pmaptap.Writer``) with the
writer's identity (run, process, host, attempt, clock).

Every field of a gathered or per-shard record but the step, the value and
the time is the same at every step of a site, so those records are copies
of a per-site template (``Record.template``, ``from_template``,
``line_pieces``, ``put_lines``: tapfile/record/format.py); this module
decides when."""

from __future__ import annotations

import hashlib
import time
import weakref
from typing import Any, Callable, Protocol

import numpy as np

from pmaptap._common.spec import Layout, TapSpec
from pmaptap._host.pipeline.encode import encode_rows, encode_tree
from pmaptap._host.pipeline.payload import Copy
from pmaptap.tapfile.record import RawArray, Record, meta_record, new_record
from pmaptap.tapfile.source import npy_header


class Site(Protocol):
    """What the builder reads of a tap site's table (aggregate.py's
    ``_Table``): per flat coordinate, its device, process and coordinates;
    the local ones; every device and process."""

    devices: list
    processes: list
    coord_dicts: list
    local: list
    all_devices: tuple
    all_processes: tuple


def vhash(key: bytes) -> str:
    """A replicated record's ``vhash``: the digest of its value's bitwise
    identity (aggregate.value_key), whichever writer made it."""
    return hashlib.blake2b(key, digest_size=8).hexdigest()


def _unverified(spec: TapSpec) -> dict | None:
    """What a replicated record of a ``verify_replicated=False`` tap says:
    its one copy was compared with nothing (``"verified": false``)."""
    return {"verified": False} if spec.transport.layout is Layout.VERIFIED_OFF else None


class RecordBuilder:
    """Every record of one writer (a session's pipeline, a ``Writer``),
    stamped with its identity."""

    def __init__(
        self,
        run: str,
        process: int,
        host: str,
        *,
        attempt: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.run, self.process, self.host = run, process, host
        self.attempt = attempt
        self.clock = clock
        # Per (tap id, axis sizes, batch_dims, leaves sent as statistics):
        # the per-device templates of a gathered site (one per local
        # device), and per dtype, each one's line cut around its step,
        # value and time (None where it cannot be: Record.line_pieces);
        # and (with "verified") the replicated template.
        self._per_device_templates: dict[tuple, list[dict]] = {}
        self._per_device_lines: dict[tuple, list] = {}
        self._replicated_templates: dict[tuple, dict] = {}
        # Per-shard taps: per ShardPlacement (one per tap per lowering, so
        # dropped with its executable), per (site, partition): the record
        # template of its per_device records.
        self._shard_templates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------ any record
    def record(
        self,
        *,
        process: int | None = None,
        time: float | None = None,
        key: bytes | None = None,
        **fields: Any,
    ) -> Record:
        """A record of this writer: its run, host and attempt, ``process``
        (default: this writer's; a per_device record: its device's), ``time``
        (default: now) and, from ``key``, the ``vhash``."""
        if key is not None:
            fields["vhash"] = vhash(key)
        return new_record(
            run=self.run,
            process=self.process if process is None else process,
            time=self.clock() if time is None else time,
            host=self.host,
            attempt=self.attempt,
            **fields,
        )

    def meta(
        self, name: str, count: int, step: int, extra: dict, *, attempt: int | None = None
    ) -> Record:
        """A ``kind="meta"`` record of this writer (its value ``count``)."""
        return meta_record(
            count=count,
            run=self.run,
            name=name,
            step=step,
            process=self.process,
            time=self.clock(),
            host=self.host,
            attempt=self.attempt if attempt is None else attempt,
            extra=extra,
        )

    # ------------------------------------------------------------ a tap site's
    def _site_record(
        self,
        spec: TapSpec,
        step: int,
        kind: str,
        encoded: tuple,
        process: int,
        now: float,
        **fields: Any,
    ) -> Record:
        """The fields every record of a tap site carries (its name, pass,
        batch dims, leaves sent as statistics) plus the kind's own ``fields``."""
        value, dtype, shape = encoded
        if spec.shards is not None and spec.transport.layout is Layout.SHARDS:
            # A shard: the global shape its index lies in (pmaptap.assemble).
            # A whole value read from one device (Layout.WHOLE, a scalar) is
            # no shard and has none.
            shapes = spec.shards.shapes
            fields["global_shape"] = (
                list(shapes[0]) if len(shapes) == 1 else [list(s) for s in shapes]
            )
        return self.record(
            name=spec.name,
            step=step,
            kind=kind,
            value=value,
            dtype=dtype,
            shape=shape,
            process=process,
            time=now,
            batch_dims=spec.site.batch_dims,
            pass_=spec.site.pass_,
            summarized=bool(spec.site.as_statistics),
            **fields,
        )

    def _per_device(
        self,
        spec: TapSpec,
        step: int,
        encoded: tuple,
        process: int,
        device: int | None,
        coords: dict,
        now: float,
        index: Any = None,
    ) -> Record:
        return self._site_record(
            spec,
            step,
            "per_device",
            encoded,
            process,
            now,
            device=device,
            coords=coords,
            index=index,
        )

    def per_device(
        self,
        spec: TapSpec,
        step: int,
        leaves: list[np.ndarray],
        process: int,
        device: int | None,
        coords: dict,
    ) -> Record:
        """The per_device record of one device's copy."""
        encoded = encode_tree(spec.site.treedef, leaves, spec.site.as_statistics)
        return self._per_device(spec, step, encoded, process, device, coords, self.clock())

    def per_device_rows(
        self, spec: TapSpec, t: Site, step: int, stacked: list[np.ndarray]
    ) -> list[Record]:
        """The per_device records of a gathered payload, one per local device
        (row k of ``stacked`` for each k in ``t.local``). Every field but the
        step, the value and the time is the same at every step of a site, so
        each record is a copy of a per-device template built (and checked)
        once (``Record.from_template``: about half the cost of building each
        record field by field)."""
        texts: list[bytes] = []
        encoded = encode_rows(
            spec.site.treedef, stacked, t.local, spec.site.as_statistics, texts=texts
        )
        # Fixed per site today; keyed anyway, so that a variant of a spec
        # (with_batch) could never take another's template.
        key = (
            spec.site.tap_id,
            spec.placement.axis_sizes,
            spec.site.batch_dims,
            spec.site.as_statistics,
        )
        templates = self._per_device_templates.get(key)
        if templates is None:
            templates = self._per_device_templates[key] = [
                self._per_device(
                    spec,
                    0,
                    (None, None, None),
                    t.processes[k],
                    t.devices[k],
                    t.coord_dicts[k],
                    0.0,
                ).template()
                for k in t.local
            ]
        now = self.clock()
        from_template = Record.from_template
        out = [
            from_template(template, step, value, dtype, shape, now)
            for template, (value, dtype, shape) in zip(templates, encoded)
        ]
        if texts and len(texts) == len(out):
            # Scalars of one dtype (encode_rows' fast path): each line is the
            # site's per-device line with the step, value and time put in,
            # instead of a dict per record and one orjson call each. That
            # encoding was most of what a scalar per_device tap costs the
            # host above handing its values over (docs/performance.md, per_device).
            lkey = (key, out[0].dtype)
            pieces = self._per_device_lines.get(lkey)
            if pieces is None:
                pieces = self._per_device_lines[lkey] = [
                    Record.line_pieces(tpl, out[0].dtype, out[0].shape) for tpl in templates
                ]
            if all(pieces):
                Record.put_lines(out, pieces, texts, step, now)
        return out

    def replicated_of_all(
        self,
        spec: TapSpec,
        step: int,
        t: Site,
        key: bytes,
        *,
        leaves: list[np.ndarray] | None = None,
        stacked: list[np.ndarray] | None = None,
    ) -> Record:
        """The replicated record of a value every copy of the tap site holds
        (agreement established, or one copy sent unverified): ``leaves``, or
        row 0 of ``stacked`` (a gathered payload whose rows all agree). A
        copy of a per-site template, as ``per_device_rows``: only the step,
        value, time and value hash change from step to step."""
        site = spec.site
        if stacked is not None:
            encoded = encode_rows(site.treedef, stacked, [0], site.as_statistics)[0]
        else:
            encoded = encode_tree(site.treedef, leaves, site.as_statistics)
        extra = _unverified(spec)
        tkey = (
            site.tap_id,
            spec.placement.axis_sizes,
            site.batch_dims,
            site.as_statistics,
            None if extra is None else tuple(sorted(extra.items())),
        )
        template = self._replicated_templates.get(tkey)
        if template is None:
            template = self._replicated_templates[tkey] = self.replicated(
                spec,
                0,
                None,
                (),
                t.all_devices,
                t.all_processes,
                b"",
                extra=extra,
                encoded=(None, None, None),
            ).template()
        value, dtype, shape = encoded
        return Record.from_template(
            template, step, value, dtype, shape, self.clock(), vhash=vhash(key)
        )

    def replicated(
        self,
        spec: TapSpec,
        step: int,
        leaves: list[np.ndarray] | None,
        as_statistics: tuple,
        devices: tuple,
        processes: tuple,
        key: bytes,
        *,
        divergent: bool = False,
        extra: dict | None = None,
        index: Any = None,
        encoded: tuple | None = None,
    ) -> Record:
        """The replicated record of one value held by ``devices`` (on
        ``processes``); ``as_statistics``: TapSite.as_statistics's form.
        ``encoded``: the value already encoded (a template's placeholders)
        instead of ``leaves``."""
        if encoded is None:
            encoded = encode_tree(spec.site.treedef, leaves, as_statistics)
        return self._site_record(
            spec,
            step,
            "replicated",
            encoded,
            self.process,
            self.clock(),
            replicas=len(devices),
            devices=devices,
            processes=processes,
            divergent=divergent,
            extra=extra,
            index=index,
            vhash=vhash(key),
        )

    def replicated_of_holders(
        self, spec: TapSpec, step: int, holders: list[Copy], divergent: bool
    ) -> Record:
        """The replicated record of one value and the copies that hold it
        (all of a step's copies, or those of one of its divergent values)."""
        extra = _unverified(spec)
        if divergent:
            # Which coordinates held this value: the device may be unknown
            # (null) but the coordinates never are. Beside "verified": false,
            # not instead of it: a leader's copy sent unverified stays so.
            extra = {
                **(extra or {}),
                "holders": [
                    {
                        "device": h.device,
                        "process": h.process,
                        "coords": dict(zip(spec.placement.axis_names, h.coords)),
                    }
                    for h in holders
                ],
            }
        return self.replicated(
            spec,
            step,
            holders[0].leaves,
            spec.site.as_statistics,
            tuple(h.device for h in holders),
            tuple(sorted({h.process for h in holders})),
            holders[0].key,
            divergent=divergent,
            extra=extra,
        )

    def per_device_of_copy(self, spec: TapSpec, step: int, cp: Copy) -> Record:
        """The per_device record of one device's copy (grouped path)."""
        return self.per_device(
            spec,
            step,
            cp.leaves,
            cp.process,
            cp.device,
            dict(zip(spec.placement.axis_names, cp.coords)),
        )

    # ------------------------------------------------------------ shards
    def per_device_of_shard(self, spec: TapSpec, step: int, cp: Copy) -> Record:
        """The per_device record of one shard's copy (with its index)."""
        return self._per_device(
            spec,
            step,
            encode_tree(spec.site.treedef, cp.leaves, cp.as_statistics),
            cp.process,
            cp.device,
            spec.shards.coords[cp.partition],
            self.clock(),
            index=cp.index,
        )

    def per_device_of_shard_now(
        self,
        spec: TapSpec,
        step: int,
        k: int,
        index: list | None,
        leaves: list[np.ndarray],
        as_statistics: tuple,
    ) -> Record:
        """The per_device record of partition ``k``'s shard, a copy of the
        partition's template (as ``per_device_rows``: every field but the
        step, value and time is fixed for a lowering's partition; a step of
        many sharded taps makes one record per tap per device)."""
        place = spec.shards
        per = self._shard_templates.get(place)
        if per is None:
            per = self._shard_templates[place] = {}
        tkey = (spec.site.tap_id, spec.site.batch_dims, k)
        entry = per.get(tkey)
        if entry is None:
            # [template, (shape, dtype, .npy header) of a leaf stored as bytes]:
            # both fixed for a lowering's partition.
            entry = per[tkey] = [
                self._per_device(
                    spec,
                    0,
                    (None, None, None),
                    place.processes[k],
                    place.devices[k],
                    place.coords[k],
                    0.0,
                    index=index,
                ).template(),
                None,
            ]
        value, dtype, shape = encode_tree(spec.site.treedef, leaves, as_statistics)
        if type(value) is RawArray:
            # Its .npy header, made once per tap site and partition rather
            # than looked up by the writer for every shard.
            a, made = value.array, entry[1]
            if made is None or made[0] != a.shape or made[1] != a.dtype:
                made = entry[1] = (a.shape, a.dtype, npy_header(a.dtype, a.shape))
            value.header = made[2]
        return Record.from_template(entry[0], step, value, dtype, shape, self.clock())
