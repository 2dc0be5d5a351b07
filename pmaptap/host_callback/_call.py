"""``call``: the old module's host call, whose answer returns into the
computation; ordered with the taps of the same computation."""

from __future__ import annotations

import dataclasses
import inspect
import threading
from typing import Any, Callable, TypeVar

import jax
import numpy as np

from pmaptap._common.spec import Placement
from pmaptap._trace import placement
from pmaptap._trace.arguments import as_leaf
from pmaptap._trace.emit import axis_coords
from pmaptap.host_callback._linked import after_dispatched, linked_call
from pmaptap.host_callback._taps import _check_callable
from pmaptap.host_callback.executor import (
    _Devices,
    _executor,
    _name_of,
    _on_executor_thread,
)

T = TypeVar("T")


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
    computation. ``result_shape`` (synonym ``result_shape_dtypes``): a pytree
    of objects with ``shape``/``dtype`` or example arrays; None or () for no
    result; another structure, shape or dtype fails the computation naming
    both. A tuple ``arg`` is spread when the function takes exactly that many
    (``_spreads_tuple``). Not differentiable: docs/host_callback.md.
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
