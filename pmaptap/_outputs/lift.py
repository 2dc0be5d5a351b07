"""Lifting: a step's tap marks (``outputs.tap_out_p``) become extra outputs.

``lift(fun)`` traces ``fun`` to a jaxpr with the marks in it, then binds
every equation again, except those docs/architecture.md draws under "Taps
as step outputs" (a mark becomes a ``Site``; jit and custom rules inlined;
``scan`` stacked as a ``Loop``; ``cond`` with a ``valid`` flag; remat;
``shard_map`` one row per device). Anything else holding a mark (a
``while_loop`` body, whose iteration count is unknown at compile time; an
unknown primitive) is bound as it was: the mark lowers to the callback
transport's host call (``outputs._lowering``), with a warning once per site.

Why the public ``lax.scan`` / ``lax.switch`` / ``jax.shard_map`` /
``jax.checkpoint`` to bind the new bodies: they take functions and deal
with constants, weak types and varying axes as for any user code, so this
module reads only the equations' parameters (JAX's ``checkify`` threads
its error values the same way).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import sys
import threading
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import api_util, core, source_info_util
from jax._src import linear_util as lu
from jax._src.interpreters import partial_eval as pe
from jax.sharding import PartitionSpec

from pmaptap._common.fingerprint import FingerprintSpec
from pmaptap._common.lifted import (
    ONE,
    PACK_ALIGN,
    PACK_MAX_BYTES,
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
from pmaptap._common.spec import LEADER_COPY, Layout, TapSpec
from pmaptap._log import log
from pmaptap._outputs import later
from pmaptap._outputs.later import Later
from pmaptap._trace import fingerprint, placement, shardstats
from pmaptap._trace.emit import axis_coords
from pmaptap._trace.fingerprint import fingerprint_later_p, fingerprint_out_p
from pmaptap._trace.jax_support import input_vars, scan_counts, varying_of
from pmaptap._trace.marks import collect, concrete, is_tracer, step_body, tap_out_p

# The marks lifted: a tap's and a fingerprint's.
_MARKS = (tap_out_p, fingerprint_out_p)
# The equations ``run`` lifts itself, whatever their sub-jaxprs hold.
_SITES = (*_MARKS, fingerprint_later_p)


class _LaterOutput:
    """Stands for an output of a ``Later`` program among a site's operands
    while the step is lifted (it is no output of the step)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
        self.shape, self.dtype = shape, np.dtype(dtype)


class _Due:
    """Stands for a ``due`` flag (a tap's or a fingerprint's ``every``) that
    the host decides from the call's step (``where``: a ``FromArgument``
    with its ``every``): no output of the step computed from its step
    number (docs/performance.md, "An argument tapped as it came")."""

    __slots__ = ("where",)
    shape = ()
    dtype = np.dtype(bool)

    def __init__(self, where: FromArgument) -> None:
        self.where = where


class Lifted:
    """The lifted taps of one step: ``nodes`` (static, see _common/lifted.py)
    and the step's extra ``arrays`` in tree order, with ``packing`` (static:
    where each of the nodes' outputs lies among them; None: one array each,
    in order) and ``later`` (static: the fingerprints whose outputs the
    caller appends after the step). A pytree whose children are the arrays,
    so a jit returns it as outputs and gives the static part back with them."""

    __slots__ = ("nodes", "arrays", "packing", "later")

    def __init__(
        self,
        nodes: tuple[Node, ...],
        arrays: list,
        packing: Packing | None = None,
        later: tuple[Later, ...] = (),
    ) -> None:
        self.nodes, self.arrays, self.packing, self.later = nodes, list(arrays), packing, later


class _Nodes:
    """The static part of ``Lifted``: compared by identity (one per trace)."""

    __slots__ = ("nodes", "packing", "later")

    def __init__(
        self, nodes: tuple[Node, ...], packing: Packing | None, later: tuple[Later, ...]
    ) -> None:
        self.nodes, self.packing, self.later = nodes, packing, later

    # Each flattening makes a new _Nodes: equal when they hold the same
    # trace's nodes, so trees flattened twice match (Equinox's filter_jit
    # maps its filter over the outputs it partitions).
    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Nodes) and other.nodes is self.nodes

    def __hash__(self) -> int:
        return id(self.nodes)


jax.tree_util.register_pytree_node(
    Lifted,
    lambda x: (x.arrays, _Nodes(x.nodes, x.packing, x.later)),
    lambda aux, arrays: Lifted(aux.nodes, list(arrays), aux.packing, aux.later),
)


def _whole_bytes(dtype: np.dtype) -> bool:
    """Whether values of ``dtype`` are whole bytes a bitcast can pack (bool,
    integers and floats of 8 bits or more; not 4-bit types, not complex)."""
    if dtype == np.bool_:
        return True
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits >= 8
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.finfo(dtype).bits >= 8
    return False


def _pack(
    nodes: tuple[Node, ...], flat: list, bundle: bool = True, taken: dict | None = None
) -> Lifted:
    """The step's extra outputs with the small ones the host reads whole (a
    scalar tap's value, every tap's step and ``valid`` flag, a fingerprint's
    table) in one bundle of bytes, each traced value once (the step number of every
    tap is one value): one device-to-host copy a step for them instead of
    one each (docs/performance.md). The host half reads them back exactly
    (_outputs/drain.py). ``bundle`` False: none packed. A ``Later``'s
    outputs (``_LaterOutput``) are placed after all of the step's.
    ``taken``: the arguments the host reads from the call (``FromArgument``
    by the identity of their tracers), not returned where one is such an
    output."""
    taken = taken or {}
    # Per output: whether the host reads it whole: every output of a ONE
    # site; of a SHARDS site its valid, coordinates and step, and its leaves
    # where the layout is WHOLE (partition 0's copy of a replicated value;
    # others are read shard by shard); ROWS sites' outputs are read row by
    # row.
    whole: list[bool] = []
    # Per output: whether it is the same value on every device of the step
    # (a ONE site's; a SHARDS site's valid, coordinates and step): where it
    # is an argument as it came (``taken``), the host reads the call's.
    same: list[bool] = []
    for site in sites(nodes):
        leaves_whole = isinstance(site.spec, TapSpec) and site.spec.transport.layout is Layout.WHOLE
        for j, traced in enumerate(site.traced):
            if traced:
                same.append(site.where == ONE or (site.where == SHARDS and j < 3))
                whole.append(same[-1] or (site.where == SHARDS and leaves_whole))
    pieces: list = []
    placed: dict[int, Packed] = {}
    packing: list[int | Packed] = []
    own: list = []
    offset = 0
    after: list[int] = []  # the packing entries of Later outputs, in order
    for read_whole, everywhere, x in zip(whole, same, flat):
        if isinstance(x, _Due):
            packing.append(x.where)
            continue
        if isinstance(x, _LaterOutput):
            after.append(len(packing))
            packing.append(-1)
            continue
        dtype = np.dtype(x.dtype)
        nbytes = int(np.prod(x.shape, dtype=np.int64)) * dtype.itemsize
        if bundle and everywhere and nbytes <= PACK_MAX_BYTES and id(x) in taken:
            packing.append(taken[id(x)])
            continue
        if not bundle or not read_whole or nbytes > PACK_MAX_BYTES or not _whole_bytes(dtype):
            packing.append(len(own))
            own.append(x)
            continue
        hit = placed.get(id(x))
        if hit is None:
            word = x.astype(jnp.uint8) if dtype.kind == "b" else x
            if word.dtype != jnp.uint8:  # every piece bytes (no promotion)
                word = lax.bitcast_convert_type(word, jnp.uint8)
            pad = -nbytes % PACK_ALIGN
            pieces.append(word.reshape(-1))
            if pad:
                pieces.append(jnp.zeros((pad,), jnp.uint8))
            hit = placed[id(x)] = Packed(offset, nbytes, dtype, tuple(int(n) for n in x.shape))
            offset += nbytes + pad
        packing.append(hit)
    if not pieces and not after and len(own) == len(flat):
        return Lifted(nodes, flat)
    arrays = [jnp.concatenate(pieces), *own] if pieces else own
    shift = 1 if pieces else 0
    placed_at = [k + shift if isinstance(k, int) else k for k in packing]
    for j, k in enumerate(after):
        placed_at[k] = len(arrays) + j
    return Lifted(nodes, arrays, tuple(placed_at))


# ------------------------------------------------------------ the interpreter
def lift(
    fun: Callable,
    *,
    pack: bool = True,
    hash_after: bool = False,
    readable: Callable[[int | str], bool] | None = None,
) -> Callable:
    """``fun`` returning ``(its outputs, Lifted)``; meant to be traced (by
    jit, pmap, or any jit-like wrapper). Arguments that are not JAX values
    (static arguments, None, Python objects) are passed through unchanged.
    ``pack``: the small outputs in one bundle (``_pack``; not where the
    outputs gain an axis of one row per device, pmap). ``hash_after``: a
    fingerprint of outputs of the step is hashed after it (``Later``; the
    caller runs the programs: jax.jit's outputs are the function's, which
    another wrapper's may not be). ``readable``: whether the argument at a
    position or keyword is still there to read after the call (not donated:
    ``FromArgument``); None: no argument is read from the call."""

    @functools.wraps(fun)
    def lifted(*args, **kwargs):
        with collector_held():
            return _lifted(*args, **kwargs)

    def _lifted(*args, **kwargs):
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        dyn = [i for i, x in enumerate(leaves) if isinstance(x, (core.Tracer, jax.Array))]
        box: dict[str, Any] = {}

        def flat_fun(*values):
            # This trace's inputs are the body's values: what is proven
            # replicated of those (a pmap argument with in_axes=None) is of
            # these too.
            placement.same_as(values, [leaves[i] for i in dyn])
            full = list(leaves)
            for i, v in zip(dyn, values):
                full[i] = v
            a, k = jax.tree_util.tree_unflatten(tree, full)
            with step_body() if hash_after else contextlib.nullcontext():
                out = fun(*a, **k)
            out_leaves, box["tree"] = jax.tree_util.tree_flatten(out)
            # Only traced outputs go through the jaxpr; the others (an
            # Equinox module's activation function, a constant) are handed
            # back as they are, for the enclosing wrapper to treat as it
            # treats them without taps (filter_jit keeps them static,
            # jax.jit converts or rejects them).
            box["static"] = [None if is_tracer(x) else x for x in out_leaves]
            # The state ``fun`` changed in place (Flax NNX modules: nnx.jit
            # reads it off the arguments it passed): out of the jaxpr too,
            # to be written back into those arguments below.
            state = _state_of((a, k))
            state_leaves, box["state_tree"] = jax.tree_util.tree_flatten(state)
            box["state_static"] = [None if is_tracer(x) else x for x in state_leaves]
            return [x for x in out_leaves + state_leaves if is_tracer(x)]

        values = [leaves[i] for i in dyn]
        with collect():
            jaxpr, _, consts = _trace(flat_fun, values, "pmaptap.jit")
        # The step's outputs that are the function's own, by position among
        # its output leaves (the traced ones come first among the jaxpr's).
        # Not an argument returned as it came: jit hands back the argument
        # itself, whose copies are not those the step computed with.
        positions = [i for i, x in enumerate(box["static"]) if x is None]
        # One process only: there the host reads the whole bundle whatever
        # sharding XLA gives it; in a multi-process job a bundle split over
        # processes would hide its other pieces (every tap's step and flag)
        # from the processes that do not hold them.
        packed = pack and jax.process_count() == 1
        taken = {}
        if packed and readable:
            taken = _arguments((args, kwargs), len(leaves), dyn, values, readable)
        top = _Top({}, taken=taken)
        arguments = set(jaxpr.invars) | set(jaxpr.constvars)
        for v, i in zip(jaxpr.outvars, positions):
            if not isinstance(v, core.Literal) and v not in arguments:
                top.returned.setdefault(v, i)
        outs, nodes, flat = run(jaxpr, consts, values, top)
        it = iter(outs)
        full = [next(it) if x is None else x for x in box["static"]]
        state = [next(it) if x is None else x for x in box["state_static"]]
        if state:
            _update((args, kwargs), jax.tree_util.tree_unflatten(box["state_tree"], state))
        lifted = _pack(tuple(nodes), flat, bundle=packed, taken=taken)
        lifted.later = _placed(lifted, top.later, flat)
        return jax.tree_util.tree_unflatten(box["tree"], full), lifted

    return lifted


class _Held:
    """The lifts in progress (any thread), and whether the collector was on
    when the first of them began."""

    lock = threading.Lock()
    lifts = 0
    was_on = False


@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    """Python's cyclic garbage collector off while a step is lifted (on
    again after the last lift in progress ends, where it was on before the
    first began). Why: lifting holds two jaxprs of the step alive at once,
    the traced one and the one being bound; the collections of young
    objects that run meanwhile promote them as if long-lived, which sets
    off full collections of the whole heap during the trace
    (docs/performance.md, "The trace's garbage"). What dies meanwhile is
    freed by reference counting as ever; the few cycles wait for the next
    collection after it."""
    with _Held.lock:
        if _Held.lifts == 0:
            _Held.was_on = gc.isenabled()
            gc.disable()
        _Held.lifts += 1
    try:
        yield
    finally:
        with _Held.lock:
            _Held.lifts -= 1
            if _Held.lifts == 0 and _Held.was_on:
                gc.enable()


def _arguments(
    call: tuple[tuple, dict],
    n: int,
    dyn: list[int],
    values: list,
    readable: Callable[[int | str], bool],
) -> dict[int, FromArgument]:
    """The traced arguments the host can read from the call itself, by the
    identity of their tracers: a tap of one as it came (``step=step``) is
    not returned by the program. Why: on a TPU, a step whose outputs
    include one of its scalar arguments measured slower, by much more than
    the copy (docs/performance.md, "An argument tapped as it came")."""
    # Leaf i of the call's n leaves (tree_flatten((args, kwargs))):
    # (position or keyword, leaf within that argument); a dict's keys
    # flatten sorted.
    args, kwargs = call
    keys = [(p, j) for p, a in enumerate(args) for j in range(len(jax.tree_util.tree_leaves(a)))]
    for k in sorted(kwargs):
        keys += [(k, j) for j in range(len(jax.tree_util.tree_leaves(kwargs[k])))]
    out: dict[int, FromArgument] = {}
    if len(keys) != n:  # pragma: no cover - a pytree flattening as a whole only
        return out
    for i, v in zip(dyn, values):
        if readable(keys[i][0]):
            out[id(v)] = FromArgument(*keys[i], np.dtype(v.dtype), tuple(v.shape))
    return out


def _graph_nodes(tree: Any) -> list:
    """The Flax NNX objects (modules, optimizers, variables: mutable, and
    mutated in place by a step) in a tree of arguments, in tree order."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return []  # no such object exists before Flax NNX is imported
    kinds = (nnx.Pytree, nnx.Variable)
    found = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, kinds))
    return [x for x in found if isinstance(x, kinds)]


def _state_of(tree: Any) -> Any:
    nodes = _graph_nodes(tree)
    return sys.modules["flax.nnx"].state(nodes) if nodes else None


def _update(tree: Any, state: Any) -> None:
    """The arguments' NNX objects given the state their traced copies ended
    with (the lifted jaxpr ran on copies: flattened and rebuilt, as any
    pytree argument), as if ``fun`` had changed them itself."""
    sys.modules["flax.nnx"].update(_graph_nodes(tree), state)


Result = tuple[list, list[Node], list]  # outputs, lifted nodes, their arrays


@dataclasses.dataclass
class _Top:
    """What ``run`` knows at the step's own level only: which of its
    variables are outputs of the function (-> position among its output
    leaves), the fingerprints to hash after the step, with their flags, and
    the arguments read from the call."""

    returned: dict
    # (Later, its due flag's tracer, _Due or None, the leaves' tracers)
    later: list = dataclasses.field(default_factory=list)
    # The arguments the host reads from the call (_arguments)
    taken: dict = dataclasses.field(default_factory=dict)


def _placed(lifted: Lifted, later: list, flat: list) -> tuple[Later, ...]:
    """Each Later told where its ``due`` flag lies among the step's extra
    outputs (it is one of ``flat``, as ``lifted.packing`` placed them), its
    program's compile started."""
    for entry, due, leaves in later:
        if due is not None:
            k = next(i for i, x in enumerate(flat) if x is due)
            entry.flag = k if lifted.packing is None else lifted.packing[k]
        if isinstance(entry.flag, FromArgument):
            flag_aval = core.ShapedArray(entry.flag.shape, entry.flag.dtype)
        else:
            source = entry.flag_source(lifted.arrays)
            flag_aval = None if source is None else core.typeof(source)
        entry.compile_ahead(flag_aval, [core.typeof(x) for x in leaves])
    return tuple(entry for entry, _, _ in later)


def _host_due(step: Any, every: int, top: _Top | None) -> _Due | None:
    """``every``'s flag decided on the host, where ``step`` is an argument
    read from the call (at the step's own level, no mapped axes: there
    every_due is ``step % every == 0``); None where the device decides."""
    arg = None if top is None else top.taken.get(id(step))
    if arg is None or placement.mapped_axes()[0]:
        return None
    return _Due(dataclasses.replace(arg, every=every))


def _due_from_call(invals: list, eqn: core.JaxprEqn, top: _Top | None) -> list:
    """A tap mark's operands with its ``due`` flag decided on the host where
    it can be (``_host_due``): the step then returns nothing computed from
    its step number, and the flag's computation in it is left unused."""
    flag = None
    if eqn.params["traced_every"]:
        flag = _host_due(invals[1], eqn.params["spec"].site.every, top)
    return invals if flag is None else [invals[0], invals[1], flag, *invals[3:]]


def _later_site(invals, eqn, top: _Top | None) -> tuple[Site, list]:
    """A ``fingerprint_later_p`` mark: a site whose table is hashed after
    the step when every leaf is an output of the function (``top``), else
    in the step (as a fingerprint in a ``cond`` on ``due``)."""
    spec: FingerprintSpec = eqn.params["spec"]
    traced = eqn.params["traced"]
    step, *leaves = invals
    where = [None if top is None else top.returned.get(v) for v in eqn.invars[1:]]
    nbytes = sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in eqn.invars[1:])
    # The site's flag, decided on the host where it can be: a step not due
    # then reads nothing and dispatches no hash after the step, so the hash
    # leaves the step whatever its size (its compile with it); else only a
    # tree big enough to pay for a dispatch every step leaves it. A hash in
    # the step needs its flag computed there.
    flag = due = None
    if traced and spec.every > 1:
        flag = _host_due(step, spec.every, top)
    in_step = None in where or (nbytes < later.MIN_BYTES and flag is None)
    if traced and spec.every > 1:
        due = flag if flag is not None and not in_step else placement.every_due(step, spec.every)
    if in_step:
        key, table = fingerprint.hashed(spec, leaves, due)
    else:
        entry = Later(spec, tuple(where))
        top.later.append((entry, due, leaves))
        key = _LaterOutput((), np.uint32)
        table = _LaterOutput((jax.device_count(), len(leaves), 2), np.uint32)
    flag = due if flag is None else flag
    head = [axis_coords(()), step] + ([] if flag is None else [flag])
    return _site([*head, key, table], spec=spec, traced_every=flag is not None)


def run(jaxpr: core.Jaxpr, consts, args, top: _Top | None = None) -> Result:
    """Bind ``jaxpr``'s equations on ``args`` in the current trace, lifting
    the marks it holds (see the module docstring). ``top``: this is the
    step's own jaxpr."""
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    constvars, invars = input_vars(jaxpr, len(consts))
    for v, x in zip(constvars, consts):
        env[v] = x
    for v, x in zip(invars, args):
        env[v] = x
    nodes: list[Node] = []
    flat: list = []
    # Into a jaxpr being built, an equation holding no mark (and no
    # effect, whose inputs JAX renumbers) is copied as it is (_copied).
    trace = core.trace_ctx.trace
    copy = isinstance(trace, pe.DynamicJaxprTrace) and hasattr(trace, "emit_eqn")
    # Each equation's names under the caller's (the same for all of them:
    # every rule's context is left before the next equation).
    base = source_info_util.current_name_stack()
    for eqn in jaxpr.eqns:
        name_stack = base + eqn.source_info.name_stack
        if copy and not eqn.effects and eqn.primitive not in _SITES and not holds_mark(eqn):
            outvals = _copied(trace, eqn, env, name_stack)
            if outvals is not None:
                for v, x in zip(eqn.outvars, outvals):
                    env[v] = x
                continue
        invals = [read(v) for v in eqn.invars]
        with (
            source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
            eqn.ctx.manager,
        ):
            if eqn.primitive is fingerprint_later_p:
                site, arrays = _later_site(invals, eqn, top)
                nodes.append(site)
                flat += arrays
                outvals = []
            elif eqn.primitive in _MARKS:
                if eqn.primitive is fingerprint_out_p:
                    spec = eqn.params["spec"]
                    site, arrays = _site(fingerprint.lifted(spec, invals), spec=spec)
                else:
                    invals = _due_from_call(invals, eqn, top)
                    site, arrays = _site(shardstats.lifted(invals, **eqn.params), **eqn.params)
                nodes.append(site)
                flat += arrays
                outvals: Any = []
            else:
                rule = _RULES.get(eqn.primitive.name)
                lifted = None
                if holds_mark(eqn):
                    if rule is None:
                        _say_fallback(eqn, *_NO_RULE.get(eqn.primitive.name, _UNKNOWN))
                    else:
                        lifted = rule(invals, eqn)
                if lifted is not None:
                    outvals, n, f = lifted
                    nodes += n
                    flat += f
                else:
                    params = eqn.primitive.get_bind_params(eqn.params)
                    outvals = eqn.primitive.bind(*invals, **params)
        if eqn.primitive.multiple_results:
            for v, x in zip(eqn.outvars, outvals):
                env[v] = x
        else:
            env[eqn.outvars[0]] = outvals
    return [read(v) for v in jaxpr.outvars], nodes, flat


def _copied(trace: Any, eqn: core.JaxprEqn, env: dict, name_stack: Any) -> list | None:
    """``eqn``, holding no mark, added to ``trace`` (the current trace, a
    jaxpr being built) as it is, on the values ``env`` holds for its
    inputs, under ``name_stack``: its outputs' tracers. None where an input is not of the type
    the equation was traced with (a rule's output typed otherwise): the
    caller binds it then. Why not bind it always: binding runs the
    primitive's type and sharding rules again for the types the equation
    already records, most of the second pass's time; copying is how JAX
    itself inlines a jaxpr into a trace (``inline_jaxpr_into_trace``;
    docs/performance.md, "The second pass copied")."""
    values = [None if isinstance(v, core.Literal) else env[v] for v in eqn.invars]
    for v, x in zip(eqn.invars, values):
        if x is not None and core.typeof(x) != v.aval:
            return None
    src = source_info_util.SourceInfo(eqn.source_info.traceback, name_stack)
    if src.traceback is None:  # as binding under user_context(None) records
        src = src.replace(traceback=source_info_util.current().traceback)
    ins = [
        pe.DynamicJaxprTracer(trace, v.aval, v, src) if x is None else trace.to_jaxpr_tracer(x, src)
        for v, x in zip(eqn.invars, values)
    ]
    out_avals = [v.aval for v in eqn.outvars]
    return trace.emit_eqn(ins, out_avals, eqn.primitive, eqn.params, eqn.effects, src, eqn.ctx)


def _site(
    invals, *, spec: TapSpec | FingerprintSpec, traced_every: bool = False
) -> tuple[Site, list]:
    coords, step, *leaves = invals
    valid = leaves.pop(0) if traced_every else None  # outputs.mark: ``due``
    # The value is the same on every device by construction: one copy per
    # process travels (tap.py marks with such a spec only then).
    proven = isinstance(spec, TapSpec) and spec.transport.layout in LEADER_COPY
    static: list = []
    traced: list[bool] = []
    arrays: list = []
    for x in (valid, coords, step, *leaves):
        later = isinstance(x, (_LaterOutput, _Due))
        known = None if x is None or later or is_tracer(x) else concrete(x)
        if known is None and x is not None and 0 in np.shape(x):
            # Nothing to read (a tap outside any mapping has coordinates of
            # shape (0,)): its value is known by its shape, no output needed.
            known = np.zeros(np.shape(x), x.dtype)
        if x is None or known is not None:
            static.append(known)
            traced.append(False)
        else:
            static.append(None)
            traced.append(True)
            arrays.append(x)
    if spec.placement.axis_names:
        where = ROWS
    elif isinstance(spec, FingerprintSpec):
        where = ONE  # the table of every partition's fingerprints (fingerprint.lifted)
    elif spec.transport.layout in (Layout.SHARDS, Layout.WHOLE):
        where = SHARDS
    else:
        where = ONE
    site = Site(spec=spec, where=where, static=tuple(static), traced=tuple(traced), proven=proven)
    return site, arrays


# ------------------------------------------------------------ which hold marks
@functools.lru_cache(maxsize=1024)
def _jaxpr_holds_mark(jaxpr: core.Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive in _MARKS or holds_mark(eqn):
            return True
    return False


def holds_mark(eqn) -> bool:
    """Whether an equation's sub-jaxprs hold a tap mark (at any depth)."""
    return any(_jaxpr_holds_mark(j) for j in core.jaxprs_in_params(eqn.params))


_said: set = set()
# Why a tap inside a primitive without a rule cannot be an output, and what
# would make it one: (where, why, advice).
_NO_RULE = {
    "while": (
        "a while_loop",
        "a while_loop runs an unknown number of times",
        "Move the tap out of the loop, or use lax.scan / lax.fori_loop with "
        "static bounds, to make it an output.",
    ),
}
_UNKNOWN = (
    "a computation pmaptap.jit cannot see into",
    "its outputs are not pmaptap's to add to",
    "Move the tap out of it to make it an output.",
)


def _say_fallback(eqn, where: str, why: str, advice: str) -> None:
    """Warn once per tap site that it keeps the host callback."""
    for spec in _marks_in(eqn):
        fn = "pmaptap.fingerprint" if isinstance(spec, FingerprintSpec) else "pmaptap.tap"
        key = (fn, spec.name, where)
        if key in _said:
            continue
        _said.add(key)
        # Through pmaptap's logger, as every message of pmaptap (an
        # application's logging config decides; -W error does not turn a
        # working step into a failing one).
        log.warning(
            f"pmaptap: {fn}({spec.name!r}) is inside {where}: it cannot leave the "
            f"step as an output ({why}), so it is sent to the host by a host "
            f"callback, and the device waits for it there. {advice} (Said once "
            "per tap.)"
        )


def _marks_in(eqn) -> list[TapSpec | FingerprintSpec]:
    out: list[TapSpec | FingerprintSpec] = []
    for j in core.jaxprs_in_params(eqn.params):
        for e in j.eqns:
            if e.primitive in _MARKS:
                out.append(e.params["spec"])
            else:
                out += _marks_in(e)
    return out


# ------------------------------------------------------------ rules
def _inline(invals, eqn, key: str) -> Result:
    closed = eqn.params[key]
    p = eqn.params
    invals = _constrained(invals, p.get("in_shardings"))
    outs, nodes, flat = run(closed.jaxpr, closed.consts, invals)
    return _constrained(outs, p.get("out_shardings")), nodes, flat


def _constrained(values: list, shardings: Any) -> list:
    """``values`` under an inlined jit's own ``in_shardings`` /
    ``out_shardings`` (where it named one): inlining drops the jit, and
    with it the layout its caller asked for (a layer jitted with
    ``out_shardings`` would return another sharding under pmaptap.jit than
    under jax.jit). One that cannot be applied here is left out: a
    layout, never a value, is at stake."""
    if not shardings:
        return values
    out = []
    for v, sh in zip(values, shardings):
        if isinstance(sh, jax.sharding.Sharding) and is_tracer(v):
            try:
                v = lax.with_sharding_constraint(v, sh)
            except Exception:  # noqa: BLE001 - see the docstring
                pass
        out.append(v)
    return out


def _scan(invals, eqn) -> Result:
    p = eqn.params
    nc, ncar = scan_counts(p)
    consts, carry, xs = invals[:nc], invals[nc : nc + ncar], invals[nc + ncar :]
    body = p["jaxpr"]
    box: dict[str, list[Node]] = {}

    def step(c, x):
        outs, nodes, flat = run(body.jaxpr, body.consts, [*consts, *c, *x])
        box["nodes"] = nodes
        return tuple(outs[:ncar]), (tuple(outs[ncar:]), tuple(flat))

    carry_out, (ys, flat) = lax.scan(
        step,
        tuple(carry),
        tuple(xs),
        length=p["length"],
        reverse=p["reverse"],
        unroll=p["unroll"],
    )
    loop = Loop(length=p["length"], reverse=p["reverse"], children=_deeper(box["nodes"]))
    return [*carry_out, *ys], [loop], list(flat)


def _deeper(nodes: list[Node] | tuple[Node, ...]) -> tuple[Node, ...]:
    """Nodes moved inside one more loop: one more leading axis."""
    out: list[Node] = []
    for n in nodes:
        if isinstance(n, Loop):
            out.append(dataclasses.replace(n, children=_deeper(n.children)))
        else:
            rows = None if n.rows is None else n.rows + 1
            out.append(dataclasses.replace(n, loops=n.loops + 1, rows=rows))
    return tuple(out)


class _Branch(NamedTuple):
    """A cond branch lifted once: a jaxpr of its outputs, then its marks'
    arrays (``outs`` of the first, of types ``marks``), and its nodes."""

    jaxpr: core.Jaxpr
    consts: list
    nodes: list[Node]
    outs: int
    marks: list


def _cond(invals, eqn) -> Result:
    index, *ops = invals
    # Each branch is lifted once and that jaxpr is what the switch below
    # runs: lifting it again there would lift every cond nested in it twice
    # per level, so a nest of n conds would cost 2^n lifts of the innermost.
    branches: list[_Branch] = []
    for closed in eqn.params["branches"]:
        box: dict[str, Any] = {}

        def fn(*xs, closed=closed, box=box):
            outs, nodes, flat = run(closed.jaxpr, closed.consts, xs)
            box["nodes"], flat = _with_valid(nodes, flat)
            box["outs"] = len(outs)
            return [*outs, *flat]

        jaxpr, avals, consts = _trace(fn, ops)
        n = box["outs"]
        branches.append(_Branch(jaxpr, consts, box["nodes"], n, avals[n:]))

    # A branch returns every branch's marks' arrays: zeros for those not
    # taken (their valid flags false).
    def taken(b: _Branch):
        def fn(*xs):
            res = core.eval_jaxpr(b.jaxpr, b.consts, *xs)
            parts: list = []
            for c in branches:
                parts += res[b.outs :] if c is b else [_zeros(a) for a in c.marks]
            return tuple(res[: b.outs]), tuple(parts)

        return fn

    outs, flat = lax.switch(index, [taken(b) for b in branches], *ops)
    return list(outs), [node for b in branches for node in b.nodes], list(flat)


def _trace(fn: Callable, args, what: str = "pmaptap lift"):
    """(jaxpr, out avals, consts) of ``fn`` traced on the types of ``args``
    (their varying axes and shardings kept), in the current trace."""
    debug = api_util.debug_info(what, fn, args, {}).with_unknown_names()
    return pe.trace_to_jaxpr_dynamic(
        lu.wrap_init(fn, debug_info=debug), [core.typeof(x) for x in args]
    )


def _zeros(aval) -> jax.Array:
    z = lax.full(aval.shape, np.zeros((), aval.dtype), aval.dtype)
    vma = varying_of(aval)
    if vma:
        z = lax.pcast(z, tuple(sorted(vma, key=str)), to="varying")
    return z


def _with_valid(nodes, flat) -> tuple[list[Node], list]:
    """Every site's ``valid`` flag made an output (true where it ran): in a
    cond, the branches not taken say false in it."""
    it = iter(flat)
    out_flat: list = []

    def visit(ns, lengths: tuple[int, ...]) -> list[Node]:
        out: list[Node] = []
        for n in ns:
            if isinstance(n, Loop):
                out.append(
                    dataclasses.replace(n, children=tuple(visit(n.children, lengths + (n.length,))))
                )
                continue
            arrays = [next(it) for _ in range(n.outputs)]
            if not n.traced[0]:
                lead = (
                    tuple(np.shape(arrays[0])[: n.loops + (n.rows is not None)])
                    if arrays
                    else lengths
                )
                arrays.insert(0, jnp.ones(lead, jnp.bool_))
                n = dataclasses.replace(
                    n, static=(None, *n.static[1:]), traced=(True, *n.traced[1:])
                )
            out_flat.extend(arrays)
            out.append(n)
        return out

    return visit(nodes, ()), out_flat


def _remat(invals, eqn) -> Result:
    p = eqn.params
    box: dict[str, list[Node]] = {}

    def body(*xs):
        outs, nodes, flat = run(p["jaxpr"], (), xs)
        box["nodes"] = nodes
        return tuple(outs), tuple(flat)

    outs, flat = jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*invals)
    return list(outs), box["nodes"], list(flat)


def _shard_map(invals, eqn) -> Result | None:
    p = eqn.params
    mesh, manual = p["mesh"], p["newly_manual_axes"]
    axes = tuple(a for a in mesh.axis_names if a in manual)
    box: dict[str, list[Node]] = {}

    def body(*xs):
        outs, nodes, flat = run(p["jaxpr"], (), xs)
        box["nodes"] = nodes
        rows = []
        for x in flat:
            missing = tuple(a for a in axes if a not in varying_of(core.typeof(x)))
            if missing and p["check_vma"]:
                x = lax.pcast(x, missing, to="varying")
            rows.append(x[None])
        return tuple(outs), tuple(rows)

    if placement.mapped_axes()[0]:
        # This shard_map is itself inside a shard_map's (or pmap's) body:
        # its marks alone keep their host callbacks (the warning names
        # them); the enclosing body's own marks are lifted as usual.
        _say_fallback(
            eqn,
            "a shard_map inside a shard_map",
            "the inner one's devices are not laid out in the outer one's outputs",
            "Move the tap to the outer shard_map's body to make it an output.",
        )
        return None
    outs, flat = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(p["in_specs"]),
        out_specs=(tuple(p["out_specs"]), PartitionSpec(axes)),
        axis_names=set(manual),
        check_vma=p["check_vma"],
    )(*invals)
    return list(outs), list(on_rows(box["nodes"])), list(flat)


def on_rows(nodes) -> tuple[Node, ...]:
    """Nodes whose outputs gained a leading axis of one row per device."""
    out: list[Node] = []
    for n in nodes:
        if isinstance(n, Loop):
            out.append(dataclasses.replace(n, children=on_rows(n.children)))
        else:
            out.append(dataclasses.replace(n, rows=0))
    return tuple(out)


_RULES: dict[str, Callable[[list, Any], Result | None]] = {
    "jit": functools.partial(_inline, key="jaxpr"),
    "pjit": functools.partial(_inline, key="jaxpr"),
    "closed_call": functools.partial(_inline, key="call_jaxpr"),
    "core_call": functools.partial(_inline, key="call_jaxpr"),
    "custom_jvp_call": functools.partial(_inline, key="call_jaxpr"),
    "custom_vjp_call": functools.partial(_inline, key="call_jaxpr"),
    "custom_vmap_call": functools.partial(_inline, key="call"),
    "scan": _scan,
    "cond": _cond,
    "remat2": _remat,
    "checkpoint": _remat,
    "shard_map": _shard_map,
}
