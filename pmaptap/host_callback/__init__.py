"""``jax.experimental.host_callback`` (removed in JAX 0.8) on today's JAX.

Old code keeps working after changing only the import::

    from pmaptap import host_callback as hcb
    hcb.id_tap(tap_func, x)          # tap_func(x, transforms) on the host
    hcb.id_print(x, what="x")        # prints "what: x" and then x
    y = hcb.call(np.linalg.eigvals, m, result_shape=...)
    hcb.barrier_wait()               # taps done; raises CallbackException once

How it is built (see docs/host_callback.md): ``id_tap``/``id_print`` bind
their own primitive (``_linked.py``), an identity whose lowering ties the
returned value to the host call and whose rules are the old module's;
``call`` binds a second one that returns the host's answer. Both carry one
ordered effect, so JAX threads a token through every tap, print and call of
a computation: they run in program order on each device. Their host
function runs on XLA's callback thread, which holds the GIL and blocks its
device, so a tap only appends the payload to a queue. One background thread
per process (the *executor*, created lazily) resolves the device and runs
the user's functions, in the order the callbacks arrived. A raising tap
function is caught there and reported once, by the next ``barrier_wait``.
``call``'s callback thread hands the work to the same executor and waits
for the result; see ``_CallJob.on_callback_thread`` for why.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import threading
from typing import Any, Callable, TypeVar

import jax
import numpy as np

from pmaptap._common.spec import Placement
from pmaptap._common.switch import taps_off
from pmaptap._trace import placement
from pmaptap._trace.arguments import as_leaf, check_dtype, is_key
from pmaptap._trace.emit import axis_coords
from pmaptap.errors import CallbackException
from pmaptap.host_callback._linked import after_dispatched, can_tie, linked_call, linked_tap
from pmaptap.host_callback.executor import (
    _Devices,
    _executor,
    _format,
    _name_of,
    _on_executor_thread,
)

T = TypeVar("T")

__all__ = [
    "CallbackException",
    "barrier_wait",
    "call",
    "id_print",
    "id_tap",
    "stop_outfeed_receiver",
]


def barrier_wait(logging_name: str | None = None) -> None:
    """Wait until every tap, print and call dispatched so far has run on the
    host; then raise ``CallbackException`` if a tap function raised since the
    previous barrier (once: the next barrier starts clean).

    ``logging_name`` names this barrier in the error message."""
    if _on_executor_thread():
        raise RuntimeError(
            "pmaptap.host_callback.barrier_wait() was called from inside a tap "
            "or call function; it would wait for itself. Call it from the "
            "thread that runs the computation."
        )
    # effects_barrier returns once every callback dispatched so far has run,
    # i.e. every tap has been *queued*; the ticket taken after it covers them.
    jax.effects_barrier()
    ex = _executor()
    ex.wait(ex.ticket())
    errors = ex.take_errors()
    if errors:
        raise _callback_exception(errors, logging_name) from errors[0][0]


def _callback_exception(
    errors: list[tuple[BaseException, str]], logging_name: str | None
) -> CallbackException:
    """The old module's message ("... Last one was: ...") naming the tap
    function that raised last; the first error (``__cause__``/``original``)
    is shown in full when there were several."""
    where = f" (barrier {logging_name!r})" if logging_name else ""
    last, last_name = errors[-1]
    first, first_name = errors[0]
    msg = (
        f"There were exceptions during callback processing{where}. Last one "
        f"was: {last_name}: {type(last).__name__}: {last}"
    )
    if len(errors) > 1:
        msg += (
            f"\nFirst one (of {len(errors)}: it and {len(errors) - 1} more), "
            f"in {first_name}:\n{_format(first)}"
        )
    else:
        msg += "\n" + _format(first)
    return CallbackException(msg, tuple(e for e, _ in errors))


def stop_outfeed_receiver() -> None:
    """Kept for old code: waits for pending taps like ``barrier_wait`` but
    raises nothing (errors stay for the next ``barrier_wait``). There is no
    outfeed receiver to stop any more."""
    jax.effects_barrier()
    ex = _executor()
    ex.wait(ex.ticket())


# --------------------------------------------------------------- id_tap
class _TapConsumer:
    """The host function of one traced ``id_tap``: runs on XLA's callback
    thread (or the caller's, eagerly), so it only queues the work."""

    def __init__(
        self,
        tap_func: Callable,
        with_device: bool,
        devices: _Devices,
        where: Placement,
        treedef: Any,
    ) -> None:
        self.tap_func = tap_func
        self.with_device = with_device
        self.devices = devices
        self.where = where
        self.treedef = treedef

    def __call__(self, transforms: tuple, coords: Any, *arrays: Any) -> None:
        _executor().submit(functools.partial(self._run, transforms, coords, arrays))

    def _run(self, packed: tuple, coords: Any, arrays: tuple) -> None:
        try:
            arg = jax.tree_util.tree_unflatten(self.treedef, list(arrays))
            # The old module's form: ("batch", {"batch_dims": ...}) and
            # ("transpose", {}), in the order they were applied.
            transforms = tuple(
                (t[0], {"batch_dims": t[1]} if t[0] == "batch" else {}) for t in packed
            )
            if self.with_device:
                self.tap_func(arg, transforms, device=self.devices.resolve(self.where, coords))
            else:
                self.tap_func(arg, transforms)
        except BaseException as e:  # noqa: BLE001 - reported by barrier_wait
            _executor().record_error(e, _name_of(self.tap_func))


# Keyword arguments that old code passes to id_tap but that id_tap does not
# take (any more): each with what to write instead.
_REMOVED_TAP_KWARGS = {
    "what": "it is an id_print argument: use hcb.id_print(x, what=...), or "
    "functools.partial(tap_func, what=...) to pass it to your function",
    "output_stream": "it is an id_print argument: use hcb.id_print(x, output_stream=...)",
    "threshold": "it is an id_print argument: use hcb.id_print(x, threshold=...)",
    "callback_flavor": "pmaptap has one implementation; delete the argument",
    "result_shape": "id_tap returns its argument; to get a value back from "
    "the host use hcb.call(f, x, result_shape=...)",
}


def _removed_kwargs_error(kwargs: dict) -> TypeError:
    name = sorted(kwargs)[0]
    why = _REMOVED_TAP_KWARGS.get(
        name,
        f"keyword arguments are no longer passed to the tap function: use "
        f"functools.partial(tap_func, {name}=...) or a closure",
    )
    more = f" (also: {', '.join(sorted(kwargs)[1:])})" if len(kwargs) > 1 else ""
    # The old module's words ("Support for **kwargs in ``id_tap`` has been
    # removed") stay in the message: code and tests that match them keep working.
    return TypeError(
        f"pmaptap.host_callback.id_tap got the removed keyword argument {name!r}{more}: {why}. "
        "(Support for **kwargs in ``id_tap`` has been removed.)"
    )


def id_tap(
    tap_func: Callable,
    arg: T,
    *,
    result: Any = None,
    tap_with_device: bool = False,
    device_index: int = 0,
    tap_with_transform: bool = False,
    **kwargs: Any,
) -> T:
    """Identity on ``arg`` (or returns ``result``) that calls
    ``tap_func(arg, transforms)`` on the host with ``arg`` as NumPy arrays.

    Taps, prints and calls of one computation run in program order on each
    device, whether or not data flows between them (in loops, conds, nested
    jit and under vmap too), and the returned value depends on the host
    call, so whatever uses it runs after ``tap_func`` was dispatched. A
    typed PRNG key is tapped as its key data. ``transforms`` is ``()`` under plain jit and one
    ``("batch", {"batch_dims": (0 or None, ...)})`` per enclosing ``vmap``,
    innermost first (``None``: that leaf was not batched and arrives as is).
    ``tap_with_device=True`` adds ``device=`` (the jax Device the value lived
    on; under pmap/shard_map the tap runs once per device). ``result`` is
    returned instead of ``arg`` and is not sent. ``tap_with_transform`` is
    accepted for old tutorials: ``transforms`` is always passed.
    Exceptions in ``tap_func`` never reach the computation; the next
    ``barrier_wait()`` raises ``CallbackException``.
    """
    del tap_with_transform  # the second positional argument is always passed
    if kwargs:
        raise _removed_kwargs_error(kwargs)
    fn = "pmaptap.host_callback.id_tap"
    _check_callable(tap_func, fn, "tap_func")
    devices = _Devices(device_index, fn)
    name = _name_of(tap_func)
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(arg)
    leaves = [as_leaf(p, x, name, fn) for p, x in path_leaves]
    for (p, _), x in zip(path_leaves, leaves):
        check_dtype(p, x, name, fn)
    out = arg if result is None else result
    if taps_off():
        return out  # pmaptap.untapped: checked, then removed
    _executor()  # start the thread here, not on XLA's callback thread
    where, raw_names = placement.current(leaves)
    consumer = _TapConsumer(tap_func, bool(tap_with_device), devices, where, treedef)
    traced = any(isinstance(x, jax.core.Tracer) for x in leaves + jax.tree_util.tree_leaves(out))
    if not traced:
        # Eager: the call happens now, on this thread, after the taps of the
        # computations dispatched before, and ``out`` is returned as it is.
        after_dispatched()
        consumer((), np.zeros((0,), np.int32), *[np.asarray(x) for x in leaves])
        return out
    # The value returned goes through the primitive, which ties it to the
    # host call (program order) and, when ``arg`` is a tangent in a
    # custom_jvp rule under grad, makes reverse mode tap its cotangent
    # (see _linked.py).
    coords = axis_coords(raw_names)
    if result is None:
        outs, _ = linked_tap(consumer, coords, leaves)
        tied = [_untie(x, o) for x, o in zip(jax.tree_util.tree_leaves(arg), outs)]
        return jax.tree_util.tree_unflatten(treedef, tied)
    res_leaves, res_treedef = jax.tree_util.tree_flatten(result)
    idx = [i for i, x in enumerate(res_leaves) if can_tie(_tie_data(x))]
    _, passed = linked_tap(consumer, coords, leaves, [_tie_data(res_leaves[i]) for i in idx])
    for i, x in zip(idx, passed):
        res_leaves[i] = _untie(res_leaves[i], x)
    return jax.tree_util.tree_unflatten(res_treedef, res_leaves)


def _tie_data(x: Any) -> Any:
    # A typed PRNG key is tied through its key data (see _untie).
    return jax.random.key_data(x) if is_key(x) else x


def _untie(original: Any, tied: Any) -> Any:
    """What ``id_tap`` returns for a leaf: ``tied`` (the leaf's value, or a
    key's data, through the primitive) in the leaf's own type, or the leaf
    itself where no tie applies (Python scalars keep their type, empty and
    non-numeric arrays)."""
    if is_key(original):
        return jax.random.wrap_key_data(tied, impl=jax.random.key_impl(original))
    return tied if can_tie(original) else original


# --------------------------------------------------------------- id_print
def _print_tap_func(
    arg: Any,
    transforms: tuple,
    *,
    device: Any = None,
    output_stream: Any = None,
    threshold: int | None = None,
    **kwargs: Any,
) -> None:
    """The old module's printer: sorted ``key: value`` pairs (``what``, other
    kwargs, ``transforms`` and ``device`` when present) on one line, then the
    value with arrays via ``np.array2string(threshold=...)``."""
    if transforms:
        kwargs["transforms"] = [(n, p) if p else n for n, p in transforms]
    if device is not None:
        kwargs["device"] = device
    lines = []
    if kwargs:
        lines.append(" ".join(f"{k}: {v}" for k, v in sorted(kwargs.items())))
    lines.append(_pp(arg, threshold))
    text = "\n".join(lines) + "\n"
    if output_stream is not None:
        output_stream.write(text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def _pp(v: Any, threshold: int | None, indent: int = 0, width: int = 80) -> str:
    """Containers as ``( a b )`` / ``[ a b ]`` / ``{ k=a }`` like the old
    printer; one line when it fits in ``width``, else one element a line."""
    if isinstance(v, np.ndarray):
        return np.array2string(v, threshold=threshold)
    if isinstance(v, (tuple, list, dict)):
        open_, close = (
            ("{", "}")
            if isinstance(v, dict)
            else ("(", ")")
            if isinstance(v, tuple)
            else ("[", "]")
        )
        items = (
            [f"{k}=" + _pp(x, threshold, indent + 2, width) for k, x in sorted(v.items())]
            if isinstance(v, dict)
            else [_pp(x, threshold, indent + 2, width) for x in v]
        )
        flat = f"{open_} " + " ".join(items) + f" {close}"
        if "\n" not in flat and indent + len(flat) <= width:
            return flat
        pad = "\n" + " " * (indent + 2)
        return f"{open_} " + pad.join(items) + f" {close}"
    return str(v)


def id_print(
    arg: T,
    *,
    result: Any = None,
    what: str | None = None,
    output_stream: Any = None,
    threshold: int | None = None,
    tap_with_device: bool = False,
    device_index: int = 0,
    **kwargs: Any,
) -> T:
    """Like ``id_tap`` with a printer: prints ``what`` and any other keyword
    arguments (sorted ``key: value``), then ``arg`` with arrays formatted by
    ``np.array2string(threshold=threshold)``, to ``output_stream.write`` or
    stdout. Returns ``arg`` (or ``result``)."""
    if what is not None:
        kwargs["what"] = what
    printer = functools.partial(
        _print_tap_func, output_stream=output_stream, threshold=threshold, **kwargs
    )
    return id_tap(
        printer, arg, result=result, tap_with_device=tap_with_device, device_index=device_index
    )


# --------------------------------------------------------------- call
def _check_callable(f: Any, fn: str, what: str) -> None:
    if not callable(f):
        raise TypeError(f"{fn}: {what} must be callable, got {type(f).__name__} ({f!r}).")


def _result_avals(result_shape: Any, fn: str):
    """(treedef, [ShapeDtypeStruct]) from a pytree of shape/dtype holders,
    example arrays or numeric scalars; dtypes canonicalized like JAX does."""
    leaves, treedef = jax.tree_util.tree_flatten(result_shape)
    avals = []
    for path, leaf in zip(_paths(treedef), leaves):
        try:
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
                shape, dtype = tuple(leaf.shape), leaf.dtype
            elif isinstance(leaf, (bool, int, float, complex, np.generic)):
                shape, dtype = np.shape(leaf), np.asarray(leaf).dtype
            else:
                raise TypeError(type(leaf).__name__)
            dtype = jax.dtypes.canonicalize_dtype(dtype)
        except Exception:  # noqa: BLE001 - rephrased below
            # The old module's words ("The values must be either numeric
            # scalars, or must have 'shape' and 'dtype' attributes") stay in
            # the message for code and tests that match them.
            raise ValueError(
                f"{fn}: result_shape{path} is {leaf!r}; each leaf must have "
                "`shape` and `dtype` (jax.ShapeDtypeStruct, an example array) "
                "or be a numeric scalar. Use None or () for no result. (The "
                "values must be either numeric scalars, or must have 'shape' "
                "and 'dtype' attributes.)"
            ) from None
        avals.append(jax.ShapeDtypeStruct(shape, dtype))
    return treedef, avals


def _paths(treedef) -> list[str]:
    dummy = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


def _describe(treedef, avals) -> str:
    return str(
        jax.tree_util.tree_unflatten(
            treedef, [f"{np.dtype(a.dtype).name}{list(a.shape)}" for a in avals]
        )
    )


def _spreads_tuple(f: Callable, arg: Any, with_device: bool) -> bool:
    """The tuple-argument rule. A tuple ``arg`` of n elements is passed as n
    positional arguments when ``f`` accepts n of them but not a single one
    (tutorial style, ``def f(x, y)``); otherwise whole (old style,
    ``def f(xy)``). When both would bind (``def f(a, b=None)``, ``*args``,
    no inspectable signature) the old style wins, so old code keeps its
    meaning."""
    if not isinstance(arg, tuple):
        return False
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):  # builtins / ufuncs without a signature
        return False
    extra = {"device": None} if with_device else {}

    def binds(n: int) -> bool:
        try:
            sig.bind(*([None] * n), **extra)
            return True
        except TypeError:
            return False

    return binds(len(arg)) and not binds(1)


def call(
    callback_func: Callable,
    arg: Any,
    *,
    result_shape: Any = None,
    result_shape_dtypes: Any = None,
    call_with_device: bool = False,
    device_index: int = 0,
) -> Any:
    """Call ``callback_func(arg)`` on the host and return its result into the
    computation. ``result_shape`` (synonym ``result_shape_dtypes``) describes
    the result: a pytree of objects with ``shape``/``dtype`` or example
    arrays; None or () for no result. A result of another structure, shape
    or dtype fails the computation with an error naming both.

    A tuple ``arg`` is spread into positional arguments when the function
    takes exactly that many (see ``_spreads_tuple``). ``call_with_device``
    adds ``device=``. Under pmap the call runs once per device with its
    slice; under vmap once per element. Not differentiable: use
    ``jax.lax.stop_gradient`` on the argument, or a ``jax.custom_vjp``.
    """
    fn = "pmaptap.host_callback.call"
    _check_callable(callback_func, fn, "callback_func")
    if result_shape is not None and result_shape_dtypes is not None:
        raise ValueError(f"{fn}: give result_shape or result_shape_dtypes (synonyms), not both.")
    shape_spec = result_shape if result_shape is not None else result_shape_dtypes
    res_treedef, res_avals = _result_avals(shape_spec, fn)
    name = _name_of(callback_func)
    what = f"{fn}({name!r})"
    path_leaves, arg_treedef = jax.tree_util.tree_flatten_with_path(arg)
    leaves = [as_leaf(p, x, name, fn) for p, x in path_leaves]
    # Where the call runs, for call_with_device (coords -> device id).
    where, raw_names = placement.current(leaves)
    job = _CallJob(
        callback_func,
        where,
        arg_treedef,
        res_treedef,
        res_avals,
        with_device=bool(call_with_device),
        spread=_spreads_tuple(callback_func, arg, bool(call_with_device)),
        devices=_Devices(device_index, fn),
        what=what,
    )
    _executor()
    if not any(isinstance(x, jax.core.Tracer) for x in leaves):
        # Eager: nothing to compile. Run on the host now (after the taps
        # of what was dispatched before) and put the result where the
        # argument was.
        after_dispatched()
        outs = job.on_callback_thread(np.zeros((0,), np.int32), *leaves)
        dev = job.devices.by_id.get(where.eager_device) if where.eager_device is not None else None
        outs = [jax.device_put(o, dev) for o in outs]
        return jax.tree_util.tree_unflatten(res_treedef, outs)
    outs = linked_call(job.on_callback_thread, axis_coords(raw_names), leaves, res_avals, what=what)
    return jax.tree_util.tree_unflatten(res_treedef, outs)


@dataclasses.dataclass(frozen=True)
class _CallJob:
    f: Callable
    placement: Placement
    arg_treedef: Any
    res_treedef: Any
    res_avals: Any
    with_device: bool
    spread: bool
    devices: _Devices
    what: str

    def on_callback_thread(self, coords: Any, *leaves: Any) -> tuple:
        """Why the executor and not this thread: jobs there run one at a time
        in arrival order, so a call runs after every tap that reached the
        host before it (as the old module's per-device receiver thread did)
        and host state shared by tap and call functions needs no lock. The
        device waits here either way, the result is needed. Inline only when
        this *is* the executor thread (a tap function ran a computation that
        JAX executed synchronously on the calling thread, as it does on CPU):
        waiting would deadlock."""
        if _on_executor_thread():
            return self._run(coords, leaves)
        box: dict[str, Any] = {}
        done = threading.Event()

        def job() -> None:
            try:
                box["out"] = self._run(coords, leaves)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["err"] = e
            finally:
                done.set()

        _executor().submit(job)
        done.wait()
        if "err" in box:
            # Raised into XLA: the computation fails with this message (the
            # device cannot continue without a result).
            raise box.pop("err")
        return box["out"]

    def _run(self, coords: Any, leaves: tuple) -> tuple:
        np_leaves = [np.asarray(x) for x in leaves]
        arg = jax.tree_util.tree_unflatten(self.arg_treedef, np_leaves)
        args = tuple(arg) if self.spread else (arg,)
        kw = {}
        if self.with_device:
            kw["device"] = self.devices.resolve(self.placement, np.asarray(coords))
        return self._check(self.f(*args, **kw))

    def _check(self, res: Any) -> tuple:
        got_leaves, got_treedef = jax.tree_util.tree_flatten(res)
        got = [np.asarray(x) for x in got_leaves]
        got_avals = [
            jax.ShapeDtypeStruct(x.shape, jax.dtypes.canonicalize_dtype(x.dtype)) for x in got
        ]
        if not self.res_avals and not got:
            return ()  # None, () and [] all mean "no result"
        if got_treedef != self.res_treedef or any(
            (g.shape, g.dtype) != (e.shape, e.dtype) for g, e in zip(got_avals, self.res_avals)
        ):
            raise ValueError(
                f"{self.what}: the host function returned "
                f"{_describe(got_treedef, got_avals)} but result_shape expects "
                f"{_describe(self.res_treedef, self.res_avals)}. Fix "
                "result_shape, or convert the result (e.g. .astype(...), "
                ".reshape(...))."
            )
        return tuple(np.asarray(x, dtype=a.dtype) for x, a in zip(got, self.res_avals))
