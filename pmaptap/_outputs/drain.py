"""The host half of the output transport: a step's lifted taps (its extra
outputs, _outputs/lift.py) become the payloads a host callback would have
delivered, on a pmaptap thread, in dispatch order (docs/architecture.md,
"Taps as step outputs", draws submit, the drain thread and the payloads).

``submit`` runs on the training loop's thread: it starts each output's
``copy_to_host_async`` and queues the step, waiting only when more than the
bound of bytes are in flight (a slow disk slows the loop, said once; nothing
dropped). ``wait()`` (barrier.effects_barrier) returns once every step
submitted before it has been delivered. Because a payload is what the
callback would have handed over, aggregation, dedup and records are the
pipeline's own.

No JAX tracing here: the outputs are read through ``jax.Array`` methods
(``copy_to_host_async``, ``addressable_shards``, ``sharding``); the spec
and description are plain data (_common).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import os
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from pmaptap._common.fingerprint import FingerprintLayout, FingerprintSpec, lowered
from pmaptap._common.lifted import (
    ONE,
    ROWS,
    SHARDS,
    FromArgument,
    Loop,
    Node,
    Packed,
    Packing,
    Site,
    sites,
)
from pmaptap._common.shard_placement import (
    PARTITION_AXIS,
    ShardPlacement,
    _slices_by_device,
    read_statistics_rows,
)
from pmaptap._common.spec import Layout, TapSpec
from pmaptap._host import barrier, routing
from pmaptap._log import log
from pmaptap._trace.jax_support import device_assignment

# How long shutdown() waits for the drain thread to end once told to: it
# ends after the payload in its hands (a pipeline that is closing refuses
# payloads at once, and the console takes them without waiting).
STOP_GRACE_S = 2.0
# The drain thread reads the steps dispatched within REST_S together; with
# nothing submitted for IDLE_S it sleeps until a submit wakes it, and ends
# after SLEEP_S of that.
REST_S = 0.01
IDLE_S = 1.0
SLEEP_S = 30.0


@dataclasses.dataclass
class _Step:
    plan: "_Plan"
    arrays: list  # jax.Arrays, in the nodes' output order
    shards: dict[int, list]  # output position -> its addressable shards (per-shard reads)
    seq: int
    started: bool  # every output's copy to the host started (else only the gates')


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a traced step's outputs are, worked out once per trace."""

    nodes: tuple[Node, ...]
    sites: list[Site]
    per_shard: frozenset  # output positions read shard by shard
    # The outputs holding the sites' ``valid`` flags when every site has
    # one (taps and fingerprints with a traced step and ``every`` > 1):
    # read first, and a step where none is set touches nothing else.
    gates: tuple[int, ...] | None
    nbytes: int  # of one step's outputs (the in-flight bound counts them)


class Drain:
    """One per process: the queue of submitted steps and its thread.
    ``deliver(spec, payload, block=)`` and ``report(error, name)`` are
    routing's (the seam every transport hands its payloads to).

    The thread does not wake for every step: once it has read the queue
    empty it lets the steps dispatched meanwhile gather for ``REST_S`` and
    reads them together (a wake-up a step cost more than a short step's
    taps, docs/performance.md). ``wait()``, a sleeping thread, and bytes in
    flight past half the bound wake it at once."""

    def __init__(
        self, deliver: Callable[..., None], report: Callable[[BaseException, str], None]
    ) -> None:
        self._deliver_one, self._report = deliver, report
        self._cv = threading.Condition()
        self._queue: collections.deque[_Step] = collections.deque()
        self._in_flight = 0
        self._submitted = 0
        self._done = 0
        self._thread: threading.Thread | None = None
        # Set by shutdown(): the thread leaves what it has not delivered and
        # ends, so that no pmaptap thread reads a jax.Array while the
        # interpreter and XLA shut down.
        self._stop = threading.Event()
        self._abandoned = 0  # steps left part-way by shutdown()
        self._slow_said = False
        self._plans: dict[int, _Plan] = {}
        self._hurry = False  # read what is queued now (wait(), the bound)
        self._asleep = False  # the thread waits for a submit to wake it
        self._reading = False  # the thread is reading the queue until empty

    # ------------------------------------------------ the loop's thread
    def submit(
        self,
        nodes: tuple[Node, ...],
        arrays: Sequence[Any],
        max_bytes: int,
        packing: Packing | None = None,
        arguments: dict | None = None,
    ) -> None:
        if not nodes:
            return
        plan = self._plan(nodes, arrays)
        step = _Step(plan, _unpacked(arrays, packing, arguments or {}), {}, 0, plan.gates is None)
        if step.started:
            _start_copies(step)
        # else: the drain thread reads the gates (a few bytes) when it gets
        # there; a step that skips every tap starts no copy at all.
        nbytes = plan.nbytes
        with self._cv:
            # A step after shutdown() (a late exit handler's): the drain
            # runs again, and reads what shutdown() left queued, which the
            # wait for room below would otherwise wait for with no reader.
            self._stop.clear()
            while self._queue and self._in_flight + nbytes > max_bytes:
                self._ensure_thread()
                if not self._slow_said:
                    self._slow_said = True
                    log.warning(
                        f"pmaptap: {self._in_flight:,} bytes of tapped step "
                        "outputs wait for the host (the disk or the pipeline is "
                        "slower than the steps); the loop now waits for them "
                        "instead of holding more, and drops none (pmaptap."
                        f"configure(max_in_flight_bytes={max_bytes}) sets the "
                        "bound). (Said once.)"
                    )
                self._hurry = True
                self._cv.notify_all()
                self._cv.wait(0.5)
            self._submitted += 1
            step.seq = self._submitted
            self._queue.append(step)
            self._in_flight += nbytes
            if not self._ensure_thread() and (self._asleep or 2 * self._in_flight > max_bytes):
                self._hurry = True
                self._cv.notify_all()

    def _ensure_thread(self) -> bool:
        """Under the lock: start the drain thread if none runs; whether it
        was started."""
        if self._thread is not None and self._thread.is_alive():
            return False
        self._thread = threading.Thread(target=self._run, name="pmaptap-outputs", daemon=True)
        self._thread.start()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every step submitted before this call was delivered
        (False after ``timeout`` seconds, or at once after shutdown() left
        steps undelivered)."""
        with self._cv:
            target = self._submitted
            if self._done < target:
                self._hurry = True
                self._cv.notify_all()
            return (
                self._cv.wait_for(lambda: self._done >= target or self._stop.is_set(), timeout)
                and self._done >= target
            )

    def undelivered(self) -> int:
        """Steps submitted and not yet delivered to the pipeline."""
        with self._cv:
            return self._submitted - self._done

    def shutdown(self, timeout: float) -> int:
        """At exit: wait up to ``timeout`` seconds for every submitted step
        to be delivered, then end the thread (it leaves the steps it has not
        delivered, and releases their arrays) and join it, a few seconds at
        most. Returns the number of steps left undelivered."""
        self.wait(timeout)
        with self._cv:
            self._stop.set()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_GRACE_S)
        with self._cv:
            left, self._abandoned = self._submitted - self._done + self._abandoned, 0
            if thread is None or not thread.is_alive():
                # Nobody reads them now: let their arrays go before JAX's
                # own exit handlers tear the backends down.
                self._queue.clear()
                self._in_flight = 0
                self._done = self._submitted
            return left

    # ------------------------------------------------ the drain thread
    def _run(self) -> None:
        while True:
            with self._cv:
                step = self._next()
                if step is None:
                    self._thread = None
                    return
            left = False
            try:
                left = not self._deliver(step)  # stopped part-way: shutdown() counts it
            except BaseException as e:  # noqa: BLE001 - reported at flush, never lost silently
                self._report(e, "pmaptap.jit outputs")
            with self._cv:
                self._abandoned += left
                self._queue.popleft()
                self._in_flight -= step.plan.nbytes
                self._done = step.seq
                self._cv.notify_all()

    def _next(self) -> _Step | None:
        """Under the lock: the next step to read, once it is time to read
        (see the class docstring); None: the thread is to end (shutdown, or
        nothing submitted for ``SLEEP_S``)."""
        idle_since = time.monotonic()
        while not self._stop.is_set():
            if self._queue and (self._reading or self._hurry):
                self._reading = True
                return self._queue[0]
            # The queue read empty: let the next steps gather.
            self._reading = self._hurry = False
            if time.monotonic() - idle_since < IDLE_S:
                self._cv.wait_for(lambda: self._hurry or self._stop.is_set(), REST_S)
                self._reading = bool(self._queue)
                continue
            self._asleep = True  # nothing for IDLE_S: the next submit wakes us
            woke = self._cv.wait(SLEEP_S)
            self._asleep = False
            if not woke and not self._queue:
                return None
            idle_since = time.monotonic()
            self._reading = bool(self._queue)
        return None

    def _plan(self, nodes: tuple[Node, ...], arrays: Sequence[Any]) -> _Plan:
        """Once per traced step (by the identity of its nodes)."""
        plan = self._plans.get(id(nodes))
        if plan is None or plan.nodes is not nodes:
            ss = sites(nodes)
            per_shard, gates, i = set(), [], 0
            for s in ss:
                if s.traced[0]:
                    gates.append(i)
                for j, traced in enumerate(s.traced):
                    if traced:
                        if (
                            s.where == SHARDS
                            and j >= 3
                            and s.spec.transport.layout is Layout.SHARDS
                            and not _summary(s.spec, j - 3)
                        ):
                            per_shard.add(i)
                        i += 1
            plan = _Plan(
                nodes,
                ss,
                frozenset(per_shard),
                tuple(gates) if len(gates) == len(ss) else None,
                sum(int(getattr(a, "nbytes", 0)) for a in arrays),
            )
            if len(self._plans) > 1024:
                self._plans.clear()
            self._plans[id(nodes)] = plan
        return plan

    def _deliver(self, step: _Step) -> bool:
        """Hand every payload of ``step`` over; False if shutdown() stopped
        it part-way."""
        plan = step.plan
        if not step.started:
            if not any(_host(step.arrays[i]).any() for i in plan.gates or ()):
                return True  # every tap of the step skipped it
            _start_copies(step)
        views: dict[int, list[_View]] = {}
        i = 0
        for s in plan.sites:
            vs = []
            for traced in s.traced:
                if traced:
                    vs.append(_View(step.arrays[i], step.shards.get(i)))
                    i += 1
                else:
                    vs.append(None)
            views[id(s)] = vs
        for site, index in _executions(plan.nodes, ()):
            for spec, payload in _payloads(site, views[id(site)], index):
                if self._stop.is_set():
                    return False
                self._deliver_one(spec, payload, block=True)
        return True


def _start_copies(step: _Step) -> None:
    """Start every output's copy to the host (each device's own shard for
    per-shard reads: a replicated slice's copies are compared, as the
    callback transport compares them)."""
    step.started = True
    for i, a in enumerate(step.arrays):
        if i in step.plan.per_shard and len(a.sharding.device_set) > 1:
            step.shards[i] = list(a.addressable_shards)
            for s in step.shards[i]:
                _start_copy(s.data)
        else:
            _start_copy(a)


def _summary(spec: Any, j: int) -> bool:
    """Whether leaf ``j`` of a plain-jit tap travels as the table of its
    shards' statistics (_trace/shardstats.py: ``lifted``)."""
    marks = getattr(getattr(spec, "site", None), "as_statistics", ())
    return (
        bool(marks)
        and j < len(marks)
        and marks[j] is not None
        and spec.transport.layout is Layout.SHARDS
    )


def _start_copy(a: Any) -> None:
    try:
        a.copy_to_host_async()
    except Exception:  # noqa: BLE001 - the read below copies it anyway
        pass


class _Bundle:
    """One step's bundle of small outputs (_outputs/lift.py: ``_pack``), copied
    to the host once for all of them."""

    __slots__ = ("array", "_started", "_bytes")

    def __init__(self, array: Any) -> None:
        self.array, self._started, self._bytes = array, False, None

    def copy_to_host_async(self) -> None:
        if not self._started:
            self._started = True
            _start_copy(self.array)

    def bytes(self) -> np.ndarray:
        if self._bytes is None:
            self._bytes = _host(self.array)
        return self._bytes


class _Piece:
    """One of the nodes' outputs that is no array of the step's own, read as
    the output itself (``where`` describes it)."""

    __slots__ = ("where",)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.where.shape


class _Part(_Piece):
    """One output packed in a bundle. It lies where the bundle lies (the
    values packed are whole on every device of the computation:
    replicated)."""

    __slots__ = ("bundle",)

    def __init__(self, bundle: _Bundle, where: Packed) -> None:
        self.bundle, self.where = bundle, where

    @property
    def sharding(self) -> Any:
        return self.bundle.array.sharding

    def copy_to_host_async(self) -> None:
        self.bundle.copy_to_host_async()

    def host(self) -> np.ndarray:
        w = self.where
        raw = self.bundle.bytes()[w.offset : w.offset + w.nbytes]
        return raw.view(w.dtype).reshape(w.shape).copy()


class _Argument(_Piece):
    """One output the step did not return, as it is an argument of the call
    (``FromArgument``): the call's own as jit.py kept it (of its dtype)."""

    __slots__ = ("value",)

    def __init__(self, value: Any, where: FromArgument) -> None:
        self.value, self.where = value, where

    def copy_to_host_async(self) -> None:
        if hasattr(self.value, "copy_to_host_async"):  # a jax.Array
            _start_copy(self.value)

    def host(self) -> np.ndarray:
        got = _host(self.value)
        return self.where.due(got) if self.where.every else got


def _unpacked(arrays: Sequence[Any], packing: Packing | None, arguments: dict) -> list:
    """The nodes' outputs, one each, from the step's extra outputs and the
    arguments of its call (by (position or keyword, leaf): jit.py's)."""
    if packing is None:
        return list(arrays)
    bundle = _Bundle(arrays[0]) if arrays else None
    return [
        arrays[k]
        if isinstance(k, int)
        else _Argument(arguments[k.key, k.leaf], k)
        if isinstance(k, FromArgument)
        else _Part(bundle, k)
        for k in packing
    ]


class _View:
    """One output as the host reads it: the whole value (np.asarray, which
    waits for the copy started at submit), or, for per-shard reads, each
    device's own shard."""

    __slots__ = ("array", "shards", "_host", "_pieces")

    def __init__(self, array: Any, shards: list | None) -> None:
        self.array, self.shards = array, shards
        self._host: np.ndarray | None = None
        self._pieces: list | None = None

    def host(self) -> np.ndarray:
        if self._host is None:
            self._host = _host(self.array)
        return self._host

    def pieces(self) -> list[tuple[int, tuple, np.ndarray]]:
        """(device id, global index, data) of each shard this process holds."""
        if self._pieces is None:
            self._pieces = [
                (s.device.id, _index(s.index, s.data.shape), np.asarray(s.data))
                for s in self.shards or ()
            ]
        return self._pieces

    def rows(self, axis: int) -> list[int]:
        """The rows along ``axis`` this process holds."""
        a = self.array
        if getattr(a, "is_fully_addressable", True):
            return list(range(a.shape[axis]))
        held = set()
        for s in a.addressable_shards:
            sl = s.index[axis]
            start = 0 if sl.start is None else sl.start
            stop = a.shape[axis] if sl.stop is None else sl.stop
            held.update(range(start, stop))
        return sorted(held)


def _host(a: Any) -> np.ndarray:
    """An output on the host (waits for its copy)."""
    if isinstance(a, _Piece):
        return a.host()
    if getattr(a, "is_fully_addressable", True):
        return np.asarray(a)
    # A global value of a multi-process job: this process's rows (pieces
    # elsewhere stay zero; _View.rows() says which are here).
    out = np.zeros(a.shape, a.dtype)
    for s in a.addressable_shards:
        out[s.index] = np.asarray(s.data)
    return out


def _index(idx: tuple, shape: tuple) -> tuple[tuple[int, int], ...]:
    return tuple(
        (0 if s.start is None else int(s.start), (0 if s.start is None else int(s.start)) + int(n))
        for s, n in zip(idx, shape)
    )


def _executions(nodes: Sequence[Node], index: tuple[int, ...]) -> Iterator[tuple[Site, tuple]]:
    """(site, loop indices outermost first) in execution order: a loop's
    iterations in the order they ran, each running its body's sites."""
    for n in nodes:
        if isinstance(n, Loop):
            order = range(n.length - 1, -1, -1) if n.reverse else range(n.length)
            for i in order:
                yield from _executions(n.children, index + (i,))
        else:
            yield n, index


def _at(site: Site, loops: tuple[int, ...], row: int | None) -> tuple:
    """The leading index of one execution (and device row) in an output."""
    out = list(loops)
    if site.rows is not None:
        out.insert(site.rows, row)
    return tuple(out)


def _operand(site: Site, views: list, j: int, lead: tuple) -> Any:
    """Operand ``j`` of one execution (and device row): its output's piece,
    or its value known when the step was traced."""
    v = views[j]
    if v is None:
        return site.static[j]
    return v.host()[lead]


def _payloads(site: Site, views: list, loops: tuple[int, ...]) -> Iterator[tuple[Any, tuple]]:
    spec = site.spec
    if isinstance(spec, FingerprintSpec):
        yield from _fingerprint_payloads(site, views, loops)
        return

    def operand(j: int, lead: tuple):
        return _operand(site, views, j, lead)

    if site.where == ROWS:
        traced = [v for v in views if v is not None]
        rows = traced[0].rows(site.rows) if traced and site.rows is not None else [None]
        for row in rows:
            lead = _at(site, loops, row)
            valid = operand(0, lead)
            if valid is not None and not bool(valid):
                continue
            payload = (operand(1, lead), operand(2, lead)) + tuple(
                operand(j, lead) for j in range(3, len(views))
            )
            yield spec, payload
            if site.proven:
                return  # one copy per process, as the leader sends it
        return
    lead = _at(site, loops, None)
    valid = operand(0, lead)
    if valid is not None and not bool(valid):
        return
    coords, step = operand(1, lead), operand(2, lead)
    leaf_views = views[3:]
    traced = [v for v in leaf_views if v is not None]
    if site.where == ONE or not traced:
        leaves = tuple(operand(j, lead) for j in range(3, len(views)))
        yield spec, (coords, step) + leaves
        return
    devices = traced[0].array.sharding.device_set
    # Leaves above max_value_bytes: the table of their shards' statistics,
    # computed on the devices (_trace/shardstats.py).
    tables = {
        j: read_statistics_rows(operand(3 + j, lead), spec.site.batch_dims)
        for j in range(len(leaf_views))
        if _summary(spec, j)
    }
    if len(devices) == 1:
        # One device: its whole value, named (the callback cannot say which).
        leaves = [
            next(iter(tables[j - 3][1].values()))[1] if j - 3 in tables else operand(j, lead)
            for j in range(3, len(views))
        ]
        yield _on_device(site, next(iter(devices)).id), (coords, step, *leaves)
        return
    bound, place = _bound(site, leaf_views, len(loops), tables)
    if spec.transport.layout is Layout.WHOLE:
        if place.processes[0] != place.me:
            return  # partition 0's copy is read, on the process that holds it
        leaves = tuple(operand(j, lead) for j in range(3, len(views)))
        yield bound, (np.zeros((1,), np.uint32), coords, step) + leaves
        return
    # SHARDS: one payload per device this process holds, with its own shards.
    by_device: list[dict[int, np.ndarray]] = []
    for v in leaf_views:
        if v is None:
            by_device.append({})
            continue
        if v.shards is None:
            whole = v.host()[lead]
            by_device.append({d: whole for d in place.devices})
            continue
        got = {}
        for dev, idx, data in v.pieces():
            got[dev] = data[tuple(i - s for i, (s, _) in zip(lead, idx))] if lead else data
        by_device.append(got)
    for k, dev in enumerate(place.devices):
        if place.processes[k] != place.me or any(
            v is not None and dev not in by_device[j] for j, v in enumerate(leaf_views)
        ):
            continue
        leaves = tuple(
            site.static[3 + j] if v is None else by_device[j][dev] for j, v in enumerate(leaf_views)
        )
        yield bound, (np.array([k], np.uint32), coords, step) + leaves


def _fingerprint_payloads(
    site: Site, views: list, loops: tuple[int, ...]
) -> Iterator[tuple[FingerprintSpec, tuple]]:
    """A fingerprint's payloads as its callback delivers them
    (_common/fingerprint.py's three layouts; operands from
    fingerprint.lifted), each on the process whose device called back."""
    spec = site.spec
    if spec.layout is FingerprintLayout.JIT:
        lead = _at(site, loops, None)
        valid = _operand(site, views, 0, lead)
        if valid is not None and not bool(valid):
            return
        step = _operand(site, views, 2, lead)
        key, table = _operand(site, views, 3, lead), _operand(site, views, 4, lead)
        bound = lowered(int(key))
        if bound is None:  # pragma: no cover - every lowering numbers its spec
            raise RuntimeError(f"pmaptap.fingerprint({spec.name!r}): no lowering numbered {key}")
        place = bound.shards
        if place is not None and place.processes[0] != place.me:
            return
        yield bound, (step, table[: 1 if place is None else len(place.devices)])
        return
    traced = [v for v in views if v is not None]
    rows = traced[0].rows(site.rows) if traced and site.rows is not None else [None]
    gathered = spec.layout is FingerprintLayout.GATHERED
    for row in rows:
        lead = _at(site, loops, row)
        valid = _operand(site, views, 0, lead)
        if valid is not None and not bool(valid):
            continue
        coords, step, fps = (_operand(site, views, j, lead) for j in (1, 2, 3))
        if not gathered:
            yield spec, (coords, step, fps)
        elif not np.any(coords):
            # The device at coordinate 0 (a row's own coordinates: under a
            # multi-process pmap the rows are this process's devices only).
            yield spec, (step, fps)


# Specs made from a site, per site (held no longer than the site's trace):
# the one device's spec (by device id) and the spec bound to a placement (by
# the outputs' shardings).
_made: "weakref.WeakKeyDictionary[Site, dict]" = weakref.WeakKeyDictionary()


def _on_device(site: Site, dev: int) -> TapSpec:
    """The site's spec naming the one device of its computation (one spec
    per site and device: the aggregator's tables are per spec)."""
    made = _made.setdefault(site, {})
    spec = made.get(dev)
    if spec is None:
        where = dataclasses.replace(site.spec.placement, eager_device=dev)
        spec = made[dev] = dataclasses.replace(site.spec, placement=where)
    return spec


def _bound(site: Site, leaf_views: list, lead: int, tables: dict) -> tuple[TapSpec, ShardPlacement]:
    """The spec bound to the ShardPlacement its outputs' shardings give (as
    the callback's lowering binds it), once per site and sharding; a leaf's
    slices by device from its statistics ``tables`` (read_statistics_rows)
    where its statistics came instead."""
    shardings = tuple(
        (j, tables[j][0], tuple((d, i) for d, (i, _) in sorted(tables[j][1].items())))
        if j in tables
        else (None if v is None else v.array.sharding)
        for j, v in enumerate(leaf_views)
    )
    made = _made.setdefault(site, {})
    hit = made.get(shardings)
    if hit is not None:
        return hit
    first = next(v for v in leaf_views if v is not None).array
    devices, names, sizes = _device_order(first.sharding)
    import jax  # already loaded: the outputs are jax.Arrays

    shapes = tuple(
        tables[j][0]
        if j in tables
        else tuple(
            int(n) for n in (np.shape(site.static[3 + j]) if v is None else v.array.shape[lead:])
        )
        for j, v in enumerate(leaf_views)
    )
    place = ShardPlacement(
        devices=tuple(d.id for d in devices),
        processes=tuple(d.process_index for d in devices),
        axis_names=names,
        axis_sizes=sizes,
        shapes=shapes,
        me=jax.process_index(),
    )
    for j, v in enumerate(leaf_views):
        if j in tables:
            rows = tables[j][1]
            slices = [rows.get(d, (None,))[0] for d in place.devices]
            place.slices[j] = None if any(i is None for i in slices) else tuple(slices)
            continue
        if v is None:
            # Known where the step was traced (an empty array, a constant):
            # not an output, and every device holds the whole of it, as the
            # callback's lowering sees it. Unknown, it would leave the
            # record's index unknown, and the copies unmerged.
            place.slices[j] = tuple(tuple((0, n) for n in shapes[j]) for _ in place.devices)
            continue
        try:
            full = _slices_by_device(v.array.sharding, tuple(v.array.shape))
            place.slices[j] = tuple(full[d][lead:] for d in place.devices)
        except Exception:  # noqa: BLE001 - unknown stays unknown (null index)
            place.slices[j] = None
    bound = dataclasses.replace(site.spec, shards=place)
    made[shardings] = (bound, place)
    return bound, place


def _device_order(sharding: Any) -> tuple[tuple, tuple[str, ...], tuple[int, ...]]:
    """(devices in partition order, mesh axis names, sizes) of an output's
    sharding: a named sharding's mesh, row-major; else its device
    assignment, with no mesh (records then carry no coordinates)."""
    mesh = getattr(sharding, "mesh", None)
    devs = getattr(mesh, "devices", None)
    if (
        devs is not None
        and getattr(devs, "size", 0) == len(sharding.device_set)
        and tuple(mesh.axis_names) != (PARTITION_AXIS,)
    ):
        names = tuple(str(n) for n in mesh.axis_names)
        return tuple(devs.flat), names, tuple(int(s) for s in devs.shape)
    return device_assignment(sharding), (), ()


_drain: Drain | None = None
_drain_lock = threading.Lock()


def submit(
    nodes: tuple[Node, ...],
    arrays: Sequence[Any],
    max_bytes: int,
    packing: Packing | None = None,
    arguments: dict | None = None,
) -> None:
    """Queue one dispatched step's lifted taps (see the module docstring),
    with the values of its call's arguments that it did not return (by
    position or keyword, and leaf); the first one also registers the exit
    handler (``_at_exit``)."""
    global _drain
    with _drain_lock:
        if _drain is None:
            # After `import jax` (a step ran): the handler runs before
            # JAX's own exit handlers tear the backends down.
            atexit.register(_at_exit)
            _drain = Drain(routing.deliver, routing.report)
    _drain.submit(nodes, arrays, max_bytes, packing, arguments)


def _at_exit() -> None:
    """Interpreter exit after steps of pmaptap.jit / pmaptap.pmap, in one
    order whatever was registered when: the session still open is closed
    (its close waits for the steps' taps, within its close_timeout); the
    taps still on their way (to the stderr printer: no session, or its close
    gave up) get CONSOLE_EXIT_S; then the drain thread ends and the printer
    prints. Without this, the taps of the last steps, which no exit handler
    waited for, were never printed, and the drain thread, still reading
    their arrays while XLA shut down, aborted the process at times
    ("FATAL: exception not rethrown")."""
    routing.close_session_at_exit()
    left = shutdown(routing.CONSOLE_EXIT_S)
    if left:
        log.error(
            f"[pmaptap] {left} dispatched step(s) of pmaptap.jit / pmaptap.pmap "
            f"taps had not reached pmaptap {routing.CONSOLE_EXIT_S:g}s into the exit; "
            "their records are not written"
        )
    routing.close_console_at_exit()


def wait(timeout: float | None = None) -> bool:
    """Every step submitted so far delivered to the pipeline (False after
    ``timeout`` seconds)."""
    d = _drain
    return True if d is None else d.wait(timeout)


def undelivered() -> int:
    """Steps submitted and not yet delivered to the pipeline."""
    d = _drain
    return 0 if d is None else d.undelivered()


def shutdown(timeout: float) -> int:
    """See ``Drain.shutdown``; 0 where no step was ever submitted."""
    d = _drain
    return 0 if d is None else d.shutdown(timeout)


def _after_fork_in_child() -> None:
    # The parent's steps in flight are the parent's to write (as routing
    # forgets its pipelines); the child starts with no drain of its own.
    global _drain, _drain_lock
    _drain, _drain_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
barrier.register(wait, undelivered)
