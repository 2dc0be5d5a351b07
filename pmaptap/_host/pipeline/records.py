"""The record factory of the aggregator: the per-site tables and record
templates, and the builders of per_device and replicated records. How a
record is copied from a template and how a per_device record's line is cut
around its step, value and time are ``Record``'s own (tapfile/format.py:
``Record.template``, ``from_template``, ``line_pieces``, ``put_lines``);
this module decides when. ``RecordFactory`` is ``Aggregator``'s base class
(aggregate.py): its builders read the aggregator's ``run``, ``process``,
``host``, ``attempt``, ``clock`` and ``_shard_templates``."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from pmaptap._common.spec import Layout, TapSpec
from pmaptap._host.pipeline.encode import encode_tree
from pmaptap._host.pipeline.payload import Copy
from pmaptap.tapfile.record import RawArray, Record, new_record
from pmaptap.tapfile.source import npy_header


class _Table:
    """Per tap site: coordinates, device, process and counter key of every
    flat coordinate, and which of them are local (computed once)."""

    def __init__(self, spec: TapSpec, me: int) -> None:
        where = spec.placement
        n = where.total_copies
        self.coords = [where.coords_of(k) for k in range(n)]
        self.devices = [where.device_of(c) for c in self.coords]
        procs = [where.process_of(c) for c in self.coords]
        self.processes = [me if p is None else p for p in procs]
        self.local = [
            k for k in range(n) if spec.placement.device_processes is None or procs[k] == me
        ]
        # Automatic steps count per device (per coordinate where the device
        # is unknown). Outside any mapping (jit, eager) there is one counter,
        # whatever device an eager value sat on.
        self.counter_keys = [
            (d if d is not None else c) if spec.placement.axis_names else ()
            for d, c in zip(self.devices, self.coords)
        ]
        # Record fields of the gathered fast paths (shared, never mutated).
        self.coord_dicts = [dict(zip(spec.placement.axis_names, c)) for c in self.coords]
        self.all_devices = tuple(self.devices)
        self.all_processes = tuple(sorted(set(self.processes)))
        # Counter keys of the local devices, for _auto_step (built on first use).
        self.auto_keys: list[tuple] | None = None
        # Per-device record templates of the gathered path, per (batch_dims,
        # leaves sent as statistics) of the spec (see RecordFactory._per_device_records_of_rows).
        self.per_device_templates: dict[tuple, list[dict]] = {}
        # (template key, dtype) -> per device, its line cut around the step,
        # the value and the time (None where it cannot be: Record.line_pieces).
        self.per_device_lines: dict[tuple, list] = {}
        self.replicated_templates: dict[tuple, dict] = {}


def _unverified(spec: TapSpec) -> dict | None:
    """What a replicated record of a ``verify_replicated=False`` tap says:
    its one copy was compared with nothing (``"verified": false``)."""
    return {"verified": False} if spec.transport.layout is Layout.VERIFIED_OFF else None


class RecordFactory:
    """The record builders (the base class of ``Aggregator``, whose state
    they read: see the module's docstring)."""

    def _value(self, spec: TapSpec, leaves: list[np.ndarray]) -> tuple[Any, Any, Any]:
        return encode_tree(spec.site.treedef, leaves, spec.site.as_statistics)

    # Record builders: one per kind (_per_device_record, _replicated_record;
    # Aggregator.dropped_record); the *_of_* helpers say what they build it from.
    def _per_device_record_of_copy(self, spec: TapSpec, step: int, cp: Copy) -> Record:
        """The per_device record of one device's copy (grouped path)."""
        return self._per_device_record(
            spec,
            step,
            self._value(spec, cp.leaves),
            cp.process,
            cp.device,
            dict(zip(spec.placement.axis_names, cp.coords)),
            self.clock(),
        )

    def _per_device_records_of_rows(
        self,
        spec: TapSpec,
        t: "_Table",
        step: int,
        encoded: list[tuple],
        texts: list[bytes] | None = None,
    ) -> list[Record]:
        """The per_device records of a gathered payload, one per local device
        (``encoded`` in ``t.local`` order). Every field but the step, the value
        and the time is the same at every step of a site, so each record is a
        copy of a per-device template built (and checked) once by
        ``_per_device_record`` (``Record.from_template``: about half the cost
        of building each record field by field)."""
        # Fixed per site today; keyed anyway, so that a variant of a spec
        # (with_batch) could never take another's template.
        key = (spec.site.batch_dims, spec.site.as_statistics)
        templates = t.per_device_templates.get(key)
        if templates is None:
            templates = t.per_device_templates[key] = [
                self._per_device_record(
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
            pieces = t.per_device_lines.get(lkey)
            if pieces is None:
                pieces = t.per_device_lines[lkey] = [
                    Record.line_pieces(tpl, out[0].dtype, out[0].shape) for tpl in templates
                ]
            if all(pieces):
                Record.put_lines(out, pieces, texts, step, now)
        return out

    def _per_device_record(
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
        """The per_device record builder."""
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

    def _replicated_record_of_all(
        self,
        spec: TapSpec,
        step: int,
        t: _Table,
        encoded: tuple,
        key: bytes,
    ) -> Record:
        """The replicated record of a value every copy of the tap site holds
        (agreement established, or one copy sent unverified). A copy of a
        per-site template, as ``_per_device_records_of_rows``: only the step,
        value, time and value hash change from step to step."""
        extra = _unverified(spec)
        tkey = (
            spec.site.batch_dims,
            spec.site.as_statistics,
            None if extra is None else tuple(sorted(extra.items())),
        )
        template = t.replicated_templates.get(tkey)
        if template is None:
            template = t.replicated_templates[tkey] = self._replicated_record(
                spec, 0, (None, None, None), t.all_devices, t.all_processes, b"", extra=extra
            ).template()
        value, dtype, shape = encoded
        return Record.from_template(
            template,
            step,
            value,
            dtype,
            shape,
            self.clock(),
            vhash=hashlib.blake2b(key, digest_size=8).hexdigest(),
        )

    def _replicated_record_of_holders(
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
        return self._replicated_record(
            spec,
            step,
            self._value(spec, holders[0].leaves),
            tuple(h.device for h in holders),
            tuple(sorted({h.process for h in holders})),
            holders[0].key,
            divergent=divergent,
            extra=extra,
        )

    def _replicated_record(
        self,
        spec: TapSpec,
        step: int,
        encoded: tuple,
        devices: tuple,
        processes: tuple,
        key: bytes,
        *,
        divergent: bool = False,
        extra: dict | None = None,
        index: Any = None,
    ) -> Record:
        """The replicated record builder."""
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
            vhash=hashlib.blake2b(key, digest_size=8).hexdigest(),
        )

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
        batch dims, leaves sent as statistics; this run, host and attempt) plus the kind's
        own ``fields``."""
        value, dtype, shape = encoded
        if spec.shards is not None and spec.transport.layout is Layout.SHARDS:
            # A shard: the global shape its index lies in (pmaptap.assemble).
            # A whole value read from one device (Layout.WHOLE, a scalar) is
            # no shard and has none.
            shapes = spec.shards.shapes
            fields["global_shape"] = (
                list(shapes[0]) if len(shapes) == 1 else [list(s) for s in shapes]
            )
        return new_record(
            run=self.run,
            name=spec.name,
            step=step,
            kind=kind,
            value=value,
            dtype=dtype,
            shape=shape,
            process=process,
            time=now,
            host=self.host,
            batch_dims=spec.site.batch_dims,
            pass_=spec.site.pass_,
            summarized=bool(spec.site.as_statistics),
            attempt=self.attempt,
            **fields,
        )

    def _shard_value(self, spec: TapSpec, cp: Copy) -> tuple:
        return encode_tree(spec.site.treedef, cp.leaves, cp.as_statistics)

    def _per_device_record_of_shard(self, spec: TapSpec, step: int, cp: Copy) -> Record:
        """The per_device record of one shard's copy (with its index)."""
        return self._per_device_record(
            spec,
            step,
            self._shard_value(spec, cp),
            cp.process,
            cp.device,
            spec.shards.coords[cp.partition],
            self.clock(),
            index=cp.index,
        )

    def _per_device_record_of_shard_now(
        self,
        spec: TapSpec,
        step: int,
        k: int,
        index: list | None,
        leaves: list[np.ndarray],
        as_statistics: tuple,
    ) -> Record:
        """The per_device record of partition ``k``'s shard, a copy of the
        partition's template (as ``_per_device_records_of_rows``: every field
        but the step, value and time is fixed for a lowering's partition; a
        step of many sharded taps makes one record per tap per device)."""
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
                self._per_device_record(
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
