"""The demo's model, data and step (launch/train.py): an MLP trained data
parallel on synthetic data, its tapped step body for every variant, and
the step of the plain-jit variant. The benchmarks time these steps too."""

from __future__ import annotations

import math
from typing import Any, Callable

FEATURES, HIDDEN = 16, 32


def init_params(seed: int, hidden: int = HIDDEN) -> dict[str, Any]:
    """Same seed on every process, so the replicas start identical."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((FEATURES, hidden)) / math.sqrt(FEATURES)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, 1)) / math.sqrt(hidden)).astype(np.float32),
        "b2": np.zeros(1, np.float32),
    }


def make_batch(seed: int, step: int, device_index: int, n: int):
    """Synthetic regression data for one device's shard of a step: a fixed
    random teacher, fresh inputs per (step, global device index)."""
    import numpy as np

    teacher = np.random.default_rng(seed + 1).standard_normal((FEATURES, 1))
    rng = np.random.default_rng([seed, step, device_index])
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    y = np.tanh(x @ teacher).astype(np.float32)
    return x, y


def local_batches(args, step: int, first: int, n_local: int):
    """(xs, ys): this process's ``n_local`` device shards of a step, each a
    list in local device order (global device indices from ``first``)."""
    shards = [make_batch(args.seed, step, first + k, args.batch_per_device) for k in range(n_local)]
    return [s[0] for s in shards], [s[1] for s in shards]


def loss_fn(params, x, y):
    """Mean squared error of a one-hidden-layer tanh MLP."""
    import jax.numpy as jnp

    h = jnp.tanh(x @ params["w1"] + params["b1"])
    pred = h @ params["w2"] + params["b2"]
    return jnp.mean((pred - y) ** 2)


def grad_norm(grads) -> Any:
    import jax
    import jax.numpy as jnp

    return jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))


def schedule(step, peak: float, total: int):
    """Linear warm-up over 10% of the steps, then cosine decay (on device)."""
    import jax.numpy as jnp

    warm = max(1, total // 10)
    s = step.astype(jnp.float32)
    up = peak * (s + 1) / warm
    frac = jnp.clip((s - warm) / max(1, total - warm), 0.0, 1.0)
    down = peak * 0.5 * (1 + jnp.cos(jnp.pi * frac))
    return jnp.where(s < warm, up, down)


def make_body(
    axis: str, peak_lr: float, total: int, *, mark_varying: bool, taps: bool = True, every: int = 1
) -> Callable:
    """One training step as seen by one device, for pmap and shard_map:
    ``make_step`` tapped with pmaptap (or not: benchmarks/bench_train.py
    times the same step untapped). ``every``: record steps where
    ``step % every == 0``, decided on device."""
    import functools

    import pmaptap

    step_fn = make_step(
        axis,
        peak_lr,
        total,
        mark_varying=mark_varying,
        tap=functools.partial(pmaptap.tap, every=every) if taps else None,
    )
    if not taps:
        return step_fn

    def body(params, x, y, step):
        # One host callback per process per recorded step carries all four
        # taps (and with every > 1, one on-device decision for all four).
        with pmaptap.group():
            return step_fn(params, x, y, step)

    return body


def make_step(
    axis: str, peak_lr: float, total: int, *, mark_varying: bool, tap: Callable | None
) -> Callable:
    """The step itself; ``tap(value, name, step=, dedup=)`` is called with
    each value worth recording (None: no taps).

    mark_varying (shard_map): shard_map tracks which values vary across the
    axis, and the gradient of an unvarying (replicated) parameter comes back
    already summed over devices. Casting the parameters to varying first
    gives each device its own gradient, as under pmap."""
    import jax
    from jax import lax

    tap = tap or (lambda *a, **k: None)

    def step_fn(params, x, y, step):
        local = params
        if mark_varying:
            local = jax.tree.map(lambda p: lax.pcast(p, axis, to="varying"), params)
        loss, grads = jax.value_and_grad(loss_fn)(local, x, y)
        gnorm = grad_norm(grads)
        # Before pmean every device has its own gradient: one record each.
        tap(gnorm, "grad_norm", step=step, dedup="per_device")
        grads = lax.pmean(grads, axis)
        loss = lax.pmean(loss, axis)
        lr = schedule(step, peak_lr, total)
        # After pmean the loss is the same on every device of every host:
        # pmaptap writes it once for the whole job.
        tap(loss, "loss", step=step, dedup="replicated")
        tap(lr, "lr", step=step, dedup="replicated")
        tap(step, "step", step=step, dedup="replicated")
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        return params, loss

    return step_fn


def tapped_and_quiet(body: Callable, tap_every: int) -> tuple[Callable, Callable]:
    """The step to run when a step is recorded, and the one for the others.
    With --tap-every N > 1 the others run a second compilation without any
    tap (pmaptap.untapped): a computation holding a host callback takes
    JAX's slower dispatch path even when the callback does not fire."""
    import pmaptap

    return body, (pmaptap.untapped(body) if tap_every > 1 else body)


def make_jit_step(peak_lr: float, total: int, shards: int, *, taps: bool = True) -> Callable:
    """The data-parallel step for plain jit (global arrays, GSPMD): the
    gradient is the mean of each data shard's gradient, computed with a
    vmap over the shards so that each shard's norm can be tapped where it
    lives. ``taps=False``: the same step untapped (benchmarks)."""
    import jax
    import jax.numpy as jnp

    import pmaptap

    def step_fn(params, x, y, step):
        xs = x.reshape(shards, -1, x.shape[-1])
        ys = y.reshape(shards, -1, y.shape[-1])
        losses, grads = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(None, 0, 0))(params, xs, ys)
        gnorms = jax.vmap(grad_norm)(grads)  # one per data shard
        loss = jnp.mean(losses)
        lr = schedule(step, peak_lr, total)
        if taps:
            h = jnp.tanh(x @ params["w1"] + params["b1"])
            pmaptap.tap(loss, "loss", step=step, dedup="replicated")
            pmaptap.tap(gnorms, "grad_norm", step=step, dedup="per_device")
            pmaptap.tap(h, "act", step=step, dedup="per_device")
        grads = jax.tree.map(lambda g: jnp.mean(g, 0), grads)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        return params, loss

    return step_fn
