"""``id_tap`` and ``id_print``: the old module's taps, an identity on the
value whose host function runs on the executor thread in program order."""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable, TypeVar

import jax
import numpy as np

from pmaptap._common.spec import Placement
from pmaptap._common.switch import taps_off
from pmaptap._trace import placement
from pmaptap._trace.arguments import as_leaf, check_dtype, is_key
from pmaptap._trace.emit import axis_coords
from pmaptap.host_callback._linked import after_dispatched, can_tie, linked_tap
from pmaptap.host_callback.executor import (
    _Devices,
    _executor,
    _name_of,
)

T = TypeVar("T")


# --------------------------------------------------------------- id_tap
@dataclasses.dataclass(eq=False)  # eq=False: hashed by identity, as a primitive parameter
class _TapConsumer:
    """The host function of one traced ``id_tap``: runs on XLA's callback
    thread (or the caller's, eagerly), so it only queues the work."""

    tap_func: Callable
    with_device: bool
    devices: _Devices
    where: Placement
    treedef: Any

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
    """Identity on ``arg`` (or returns ``result``, not sent) that calls
    ``tap_func(arg, transforms)`` on the host with ``arg`` as NumPy arrays.

    ``transforms`` is ``()`` under plain jit and one ``("batch", {"batch_dims":
    (0 or None, ...)})`` per enclosing ``vmap``, innermost first.
    ``tap_with_device=True`` adds ``device=``; ``tap_with_transform`` is
    accepted for old tutorials. Exceptions in ``tap_func`` never reach the
    computation; the next ``barrier_wait()`` raises ``CallbackException``.
    Program order and the rest: docs/host_callback.md.
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
