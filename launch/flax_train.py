"""A Flax NNX model trained data x tensor parallel under plain ``jax.jit``,
tapped with pmaptap: the client pmaptap's sharded path is built for.

The mesh is ("data", "model") over every device of every process. ``fc1``'s
kernel is split by columns over "model", ``fc2``'s by rows (Megatron style),
the batch over "data"; optax (adamw) updates the sharded parameters. Taps,
written where the values live, never gathered:

- in ``MLP.__call__``: ``h`` the hidden activation (one record per device:
  its shard, with ``index`` and ``coords``), ``dh`` its cotangent
  (``pmaptap.tap_grad``, pass "backward"), ``y`` the output (sharded over
  "data", replicated over "model": one record per data slice, its copies
  compared);
- in the step: ``loss`` (a replicated scalar: one record per step, naming
  every device, ``copies_seen: 1``), ``grad_norm``, and every
  ``--params-every`` steps ``params``, the ``nnx.State`` of the parameters
  (written with its names: ``{"fc1": {"kernel": {"value": ...}}, ...}``);
- after the update, every step: ``state``, ``pmaptap.fingerprint`` of the
  parameters and the optimizer state: each device fingerprints its own
  shard of each, the holders of every slice (the "data" replicas of a
  "model" shard) are compared, one record per step when they agree (a
  device whose copy differs is named: ``pmaptap summary``).

The taps of a step, those inside the differentiated function included, share
one partitioned host call per device (automatic grouping); ``dh`` is written
from the backward program, its own call, and ``params`` from its own
``every`` branch.

    python -m pmaptap.launch --processes 2 --devices 4 -- \\
        python launch/flax_train.py --steps 20 --out out/flax.jsonl

At the end process 0 reads the file back and checks it (exit status 1 if a
record is missing). ``--taps raw`` makes the same calls with raw
``jax.debug.callback(partitioned=True)`` and ``--taps none`` none at all
(benchmarks).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

# Running as `python launch/flax_train.py` from a checkout without installing.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from pmaptap import distributed  # noqa: E402

FEATURES, OUT = 16, 4


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="out/flax.jsonl", help="shared tap file")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--batch-per-device", type=int, default=8)
    p.add_argument("--model-parallel", type=int, default=2, help='size of the "model" axis')
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--params-every", type=int, default=10, help="tap the parameters every N")
    p.add_argument("--run", default=None, help="run id (default: agreed)")
    p.add_argument("--layout", choices=("auto", "file", "sharded"), default="auto")
    p.add_argument(
        "--taps",
        choices=("pmaptap", "raw", "none"),
        default="pmaptap",
        help="raw: jax.debug.callback(partitioned=True) instead; none: untapped",
    )
    p.add_argument("--no-check", action="store_true", help="skip reading the file back")
    return p.parse_args(argv)


def make_mesh(model_parallel: int):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = np.array(jax.devices())  # process by process
    if devices.size % model_parallel:
        raise SystemExit(
            f"--model-parallel {model_parallel} does not divide the {devices.size} devices"
        )
    return Mesh(devices.reshape(-1, model_parallel), ("data", "model"))


def make_model_class(taps: str):
    import jax
    from flax import nnx

    import pmaptap

    init = nnx.initializers.lecun_normal()

    def noop(*_):
        return None

    class MLP(nnx.Module):
        """Two layers, tensor parallel over "model": fc1 by columns, fc2 by
        rows (the hidden activation is sharded over both axes)."""

        def __init__(self, hidden: int, rngs: nnx.Rngs) -> None:
            self.fc1 = nnx.Linear(
                FEATURES,
                hidden,
                kernel_init=nnx.with_partitioning(init, (None, "model")),
                bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",)),
                rngs=rngs,
            )
            self.fc2 = nnx.Linear(
                hidden, OUT, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs
            )

        def __call__(self, x):
            h = nnx.relu(self.fc1(x))
            if taps == "pmaptap":
                pmaptap.tap(h, "h", dedup="per_device")
                h = pmaptap.tap_grad(h, "dh", dedup="per_device")
            elif taps == "raw":
                jax.debug.callback(noop, h, partitioned=True)
            y = self.fc2(h)
            if taps == "pmaptap":
                pmaptap.tap(y, "y")
            elif taps == "raw":
                jax.debug.callback(noop, y, partitioned=True)
            return y

    return MLP


def create(args: argparse.Namespace, mesh: Any):
    """The model and optimizer, created inside jit so that every parameter
    (and optimizer state) is born sharded as its partitioning says, in one
    or many processes alike."""
    import jax
    import optax
    from flax import nnx

    MLP = make_model_class(args.taps)

    @nnx.jit
    def build():
        model = MLP(args.hidden, nnx.Rngs(args.seed))
        state = nnx.state(model)
        nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
        return model

    with jax.set_mesh(mesh):
        model = build()
        opt = nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)
    return model, opt


def make_train_step(args: argparse.Namespace):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import pmaptap

    def noop(*_):
        return None

    def train_step(model, opt, x, t, step):
        def loss_fn(m):
            loss = jnp.mean((m(x) - t) ** 2)
            if args.taps == "pmaptap":
                pmaptap.tap(loss, "loss", step=step)
            return loss

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        gnorm = optax.global_norm(grads)
        if args.taps == "pmaptap":
            pmaptap.tap(gnorm, "grad_norm", step=step)
            pmaptap.tap(nnx.state(model, nnx.Param), "params", step=step, every=args.params_every)
        elif args.taps == "raw":
            jax.debug.callback(noop, loss, gnorm, partitioned=True)
        opt.update(model, grads)
        if args.taps == "pmaptap":
            # Silent data corruption: every device's copy of what the step
            # keeps, fingerprinted where it lives (8 bytes a leaf a device
            # to the host), the copies that should agree compared.
            pmaptap.fingerprint(
                {"params": nnx.state(model, nnx.Param), "opt": nnx.state(opt, nnx.OptState)},
                "state",
                step=step,
            )
        return loss

    return nnx.jit(train_step)


def batch(args: argparse.Namespace, step: int, mesh: Any):
    """The global batch of ``step`` (x, target), each process supplying its
    own rows (those of its "data" slices)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rows = args.batch_per_device * mesh.shape["data"]
    rng = np.random.default_rng([args.seed, step])
    x = rng.standard_normal((rows, FEATURES), dtype=np.float32)
    w = np.linspace(-1, 1, FEATURES * OUT, dtype=np.float32).reshape(FEATURES, OUT)
    t = np.tanh(x @ w)
    sharding = NamedSharding(mesh, P("data", None))
    # Every process builds the same global batch and hands over its rows.
    return tuple(
        jax.make_array_from_callback(a.shape, sharding, lambda idx, a=a: a[idx]) for a in (x, t)
    )


def check(
    path: str,
    run: str,
    steps: int,
    mesh: Any,
    params_every: int,
    batch_per_device: int,
    hidden: int,
) -> list[str]:
    """Read the run back (process 0) and list what is missing or wrong."""
    import numpy as np

    import pmaptap

    recs = pmaptap.read(path, run=run)
    n_dev = mesh.devices.size
    problems = []

    def by(name):
        return [r for r in recs if r["name"] == name]

    loss = by("loss")
    if [r["step"] for r in loss] != list(range(steps)):
        problems.append(f"loss steps {[r['step'] for r in loss]}")
    for r in loss:
        if r.get("replicas") != n_dev or r.get("copies_seen") != 1:
            problems.append(f"loss record without every device: {r}")
    rows = batch_per_device * mesh.shape["data"]
    for name, backward in (("h", False), ("dh", True)):
        for step in range(steps):
            rs = [r for r in by(name) if r["step"] == step]
            if len({r["device"] for r in rs}) != n_dev:
                problems.append(f"{name} step {step}: {len(rs)} shards")
                continue
            # The global array from every process's shards (a missing or
            # overlapping slice is an error naming it).
            try:
                g = pmaptap.assemble(path, name, step, run=run, backward=backward)
            except ValueError as e:
                problems.append(f"{name} step {step}: {e}")
                continue
            if g.shape != (rows, hidden) or not np.isfinite(g).all():
                problems.append(f"{name} step {step}: assembled {g.dtype}{list(g.shape)}")
    params = by("params")
    if [r["step"] for r in params] and not all(
        isinstance(r["value"], dict) and set(r["value"]) == {"fc1", "fc2"} for r in params
    ):
        problems.append("params records without their names")
    want = sorted({s for s in range(steps) if s % params_every == 0})
    if sorted({r["step"] for r in params}) != want:
        problems.append(f"params steps {sorted({r['step'] for r in params})}, wanted {want}")
    # One fingerprint record a step: every device's copies agreed.
    state = by("state")
    if [r["step"] for r in state] != list(range(steps)):
        problems.append(f"state fingerprint steps {[r['step'] for r in state]}")
    for r in state:
        if r.get("divergent") or r.get("replicas") != n_dev:
            problems.append(f"state fingerprints differ or miss a device: {r}")
    print(
        f"read back {len(recs)} records: "
        + ", ".join(
            f"{n} {len(by(n))}" for n in ("loss", "grad_norm", "h", "dh", "y", "params", "state")
        ),
        flush=True,
    )
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    distributed.initialize()
    import jax

    import pmaptap

    mesh = make_mesh(args.model_parallel)
    model, opt = create(args, mesh)
    step_fn = make_train_step(args)
    session = None
    if args.taps == "pmaptap":
        session = pmaptap.Session(args.out, run=args.run, layout=args.layout).open()
    loss = float("nan")
    with jax.set_mesh(mesh):
        for step in range(args.steps):
            x, t = batch(args, step, mesh)
            loss = step_fn(model, opt, x, t, jax.numpy.int32(step))
    loss = float(loss)
    if jax.process_index() == 0:
        print(f"final loss {loss:.6f}", flush=True)
    if session is None:
        return 0
    run = session.run
    session.close()  # every process's records are in the file after this
    if jax.process_index() != 0 or args.no_check:
        return 0
    problems = check(
        args.out, run, args.steps, mesh, args.params_every, args.batch_per_device, args.hidden
    )
    for p in problems:
        print(f"PROBLEM {p}", flush=True)
    print("READBACK ok" if not problems else "READBACK failed", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
