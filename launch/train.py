"""Data-parallel MLP training on synthetic data, tapped with pmaptap.

One process per host (``jax.distributed``); the batch is split over every
device of every process; gradients and the loss are averaged with ``pmean``.
Taps:

- ``loss``      the loss after ``pmean`` (dedup="replicated": one record per
                step for the whole job, however many hosts and devices);
- ``grad_norm`` each device's gradient norm before ``pmean``
                (dedup="per_device": one record per device per step);
- ``lr``, ``step`` the learning rate and step counter (replicated);
- ``params``    with ``--fingerprint`` (or ``--fault``): every device's
                copy of the parameters fingerprinted (pmaptap.fingerprint);
                ``--fault device=D,step=S`` flips a bit in device D's copy
                before step S, and the summary names that device.

Three variants compute the same thing: ``--variant pmap``,
``--variant shard_map`` (a 1-D mesh over all devices, set with jax.set_mesh)
and ``--variant jit``: plain ``jax.jit`` over a ``NamedSharding`` mesh, the
batch on a "data" axis, the parameters replicated, no mapped axes at all.
There pmaptap taps each shard where it lives: ``grad_norm`` is a vector of
each data shard's gradient norm (one record per device, with its ``index``),
``act`` the hidden activation (one record per device: its rows of the batch)
and ``loss`` is replicated (one record per step).

Run it alone, under the local launcher, or on a cluster (launch/README.md):

    python -m pmaptap.launch --processes 2 --devices 4 -- \\
        python launch/train.py --steps 20 --out out/demo.jsonl

At the end process 0 prints a summary of this run's records.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Callable, Sequence

# Running as `python launch/train.py` from a checkout without installing.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from pmaptap import distributed  # noqa: E402

# The demo's parts live beside this file: the model and step (model.py),
# checkpoints and the injected fault (restarts.py).
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from model import (  # noqa: E402
    HIDDEN,
    local_batches,
    make_body,
    make_jit_step,
    tapped_and_quiet,
)
from restarts import (  # noqa: E402
    ckpt_path,
    fault_problem,
    inject_fault,
    log,
    maybe_die,
    parse_fault,
    save_checkpoint,
    start_params,
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", choices=("pmap", "shard_map", "jit"), default="pmap")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="out/train.jsonl", help="shared tap file")
    p.add_argument("--lr", type=float, default=0.05, help="peak learning rate")
    p.add_argument("--batch-per-device", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lock",
        choices=("flock", "soft"),
        default="flock",
        help="'soft' when --out is on NFS/Lustre (launch/README.md)",
    )
    p.add_argument(
        "--layout",
        choices=("auto", "file", "sharded"),
        default="auto",
        help="one shared file, one file per process (path.d/), or chosen by process count",
    )
    p.add_argument("--run", default=None, help="run id (default: agreed)")
    p.add_argument("--log-every", type=int, default=5, help="print the loss every N steps")
    p.add_argument(
        "--tap-every",
        type=int,
        default=1,
        help="record the taps on steps where step %% N == 0 (the "
        "other steps run an untapped compilation)",
    )
    p.add_argument(
        "--hidden", type=int, default=HIDDEN, help="width of the hidden layer (the step's cost)"
    )
    p.add_argument("--no-summary", action="store_true")
    p.add_argument(
        "--ckpt",
        default=None,
        metavar="DIR",
        help="checkpoint directory: resume from DIR/ckpt.npz if it "
        "exists (and resume the tap run: Session(resume=True))",
    )
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=10,
        metavar="N",
        help="with --ckpt: save the parameters every N steps",
    )
    p.add_argument(
        "--die-at",
        type=int,
        default=None,
        metavar="STEP",
        help="fault injection for demos and tests: on the first "
        "attempt, the last process SIGKILLs itself before STEP",
    )
    p.add_argument(
        "--fingerprint",
        action="store_true",
        help="fingerprint every device's copy of the parameters each step "
        "(pmaptap.fingerprint: the summary names a device whose copy differs)",
    )
    p.add_argument(
        "--fault",
        default=None,
        metavar="device=D,step=S",
        help="silent data corruption for demos and tests: before step S, "
        "flip a bit (bit=B, default 12) in device D's copy of the "
        "parameters; implies --fingerprint",
    )
    args = p.parse_args(argv)
    if args.fault is not None:
        try:
            args.fault = parse_fault(args.fault)
        except ValueError as e:
            p.error(str(e))
        args.fingerprint = True
    if args.ckpt_every < 1:
        p.error("--ckpt-every must be >= 1")
    if min(args.steps, args.batch_per_device, args.tap_every, args.hidden, args.log_every) < 1:
        p.error("--steps, --batch-per-device, --tap-every, --hidden and --log-every must be >= 1")
    return args


# ---------------------------------------------------------------- model


# ---------------------------------------------------------------- checkpoints


# ---------------------------------------------------------------- variants


def fingerprinted(step: Callable, args: argparse.Namespace) -> Callable:
    """``step`` whose new parameters are fingerprinted on every device
    (--fingerprint): ONE tiny gather of 8 bytes a parameter a device, the
    copies compared on the host."""
    if not args.fingerprint:
        return step
    import pmaptap

    def step_fn(params, x, y, step_no):
        params, out = step(params, x, y, step_no)
        pmaptap.fingerprint(params, "params", step=step_no)
        return params, out

    return step_fn


def train_pmap(args: argparse.Namespace) -> float:
    import jax
    import numpy as np

    n_local = jax.local_device_count()
    # pmap's axis runs over jax.devices(), process by process, so this
    # process's k-th local device has global index first + k.
    first = jax.process_index() * n_local
    body = fingerprinted(make_body("dp", args.lr, args.steps, mark_varying=False), args)
    step_fn, quiet_fn = (
        jax.pmap(b, axis_name="dp", in_axes=(0, 0, 0, None))
        for b in tapped_and_quiet(body, args.tap_every)
    )
    # One copy of the parameters per local device (pmap's leading axis).
    start, first_step = start_params(args)
    params = jax.tree.map(lambda a: np.stack([a] * n_local), start)
    loss = math.nan
    with progress_bar(args) as bar:
        for step in range(first_step, args.steps):
            maybe_die(args, step)
            if args.fault:
                params = inject_fault(params, args.fault, step)
            xs, ys = local_batches(args, step, first, n_local)
            x, y = np.stack(xs), np.stack(ys)
            fn = step_fn if step % args.tap_every == 0 else quiet_fn
            params, losses = fn(params, x, y, np.int32(step))
            save_checkpoint(args, lambda: {k: first_local(v) for k, v in params.items()}, step + 1)
            if step % args.log_every == 0 or step == args.steps - 1:
                loss = float(first_local(losses))
                report(bar, step, loss)
            bar.update()
    return loss


def first_local(a: Any) -> Any:
    """This process's first device's copy of a pmap'd replicated value (the
    parameters, the pmean'd loss), on the host. ``a[0]`` would be the first
    device of the job: JAX 0.9 cannot index a global array that spans
    processes."""
    import numpy as np

    return np.asarray(a.addressable_shards[0].data).reshape(a.shape[1:])


def host_copy(params: dict[str, Any]) -> dict[str, Any]:
    """One replica of replicated global arrays, on the host."""
    import numpy as np

    return {k: np.asarray(v.addressable_data(0)) for k, v in params.items()}


def train_shard_map(args: argparse.Namespace) -> float:
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    # All devices of all processes, process by process (as jax.devices()).
    mesh = Mesh(np.array(jax.devices()), ("dp",))
    body = fingerprinted(make_body("dp", args.lr, args.steps, mark_varying=True), args)
    step_fn, quiet_fn = (
        jax.jit(
            jax.shard_map(b, mesh=mesh, in_specs=(P(), P("dp"), P("dp"), P()), out_specs=(P(), P()))
        )
        for b in tapped_and_quiet(body, args.tap_every)
    )
    # set_mesh makes the concrete mesh visible while tracing, so pmaptap can
    # name the exact device behind every coordinate.
    with jax.set_mesh(mesh):
        return train_global(args, mesh, step_fn, quiet_fn)


def train_global(
    args: argparse.Namespace, mesh: Any, step_fn: Callable, quiet_fn: Callable
) -> float:
    """The training loop over global arrays (shard_map and jit): parameters
    replicated over ``mesh``, each batch split over its one axis, this
    process feeding the shards of its own devices."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n_local = jax.local_device_count()
    first = jax.process_index() * n_local
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, P(*mesh.axis_names))

    def global_array(local, sharding):
        return jax.make_array_from_process_local_data(sharding, local)

    start, first_step = start_params(args)
    params = jax.tree.map(lambda a: global_array(a, replicated), start)
    loss = math.nan
    with progress_bar(args) as bar:
        for step in range(first_step, args.steps):
            maybe_die(args, step)
            if args.fault:
                params = inject_fault(params, args.fault, step)
            xs, ys = local_batches(args, step, first, n_local)
            x = global_array(np.concatenate(xs), sharded)
            y = global_array(np.concatenate(ys), sharded)
            fn = step_fn if step % args.tap_every == 0 else quiet_fn
            params, out = fn(params, x, y, global_array(np.int32(step), replicated))
            save_checkpoint(args, lambda: host_copy(params), step + 1)
            if step % args.log_every == 0 or step == args.steps - 1:
                loss = float(np.asarray(out.addressable_data(0)))
                report(bar, step, loss)
            bar.update()
    return loss


def train_jit(args: argparse.Namespace) -> float:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()), ("data",))
    tapped = fingerprinted(make_jit_step(args.lr, args.steps, jax.device_count()), args)
    quiet = make_jit_step(args.lr, args.steps, jax.device_count(), taps=False)
    step_fn = jax.jit(tapped)
    quiet_fn = jax.jit(quiet) if args.tap_every > 1 else step_fn
    return train_global(args, mesh, step_fn, quiet_fn)


# ---------------------------------------------------------------- main


def progress_bar(args: argparse.Namespace):
    """Process 0's progress bar (on a terminal, or PMAPTAP_PROGRESS=1, which
    the launcher sets when its own stderr is a terminal)."""
    from pmaptap.progress import Progress

    return Progress(total=args.steps, desc="train")


def report(bar, step: int, loss: float) -> None:
    """The loss goes on the bar when one is drawn, else on a log line."""
    if bar.enabled:
        bar.postfix["loss"] = loss
    else:
        log(f"step {step:4d}  loss {loss:.5f}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    mode = distributed.initialize()  # before any JAX computation
    import jax

    if args.fault is not None:
        problem = fault_problem(args.fault, [d.id for d in jax.devices()], args.steps)
        if problem:
            print(f"train.py: error: {problem}", file=sys.stderr, flush=True)
            return 2

    import pmaptap
    from pmaptap.tapfile.analyze import summary_table

    log(
        f"pmaptap train: variant={args.variant} mode={mode} "
        f"processes={jax.process_count()} devices={jax.device_count()} "
        f"({jax.local_device_count()} local) steps={args.steps}"
    )
    t0 = time.time()
    # A restarted attempt (the launcher's --restarts sets PMAPTAP_ATTEMPT) or
    # a job resuming from a checkpoint continues the tap run: its records of
    # replayed steps supersede the earlier attempt's. A launcher's attempt 0
    # with a checkpoint too (the job launched again after its restarts ran
    # out): with --run the session continues that run above its attempts,
    # without it a new run starts (Session(resume=True) decides).
    attempt = os.environ.get("PMAPTAP_ATTEMPT", "")
    resume = attempt not in ("", "0") or bool(ckpt_path(args) and os.path.exists(ckpt_path(args)))
    with pmaptap.Session(
        args.out, run=args.run, lock=args.lock, resume=resume, layout=args.layout
    ) as session:
        train = {"pmap": train_pmap, "shard_map": train_shard_map, "jit": train_jit}[args.variant]
        train(args)
    # Leaving the block closed the session on every process (a coordinated
    # close): the file now holds every process's records.
    log(
        f"done in {time.time() - t0:.1f}s; run {session.run}"
        + (f" (attempt {session.attempt})" if session.attempt else "")
        + f" -> {args.out}"
    )
    if jax.process_index() == 0 and not args.no_summary:
        records = [r for r in pmaptap.read(args.out) if r["run"] == session.run]
        print(summary_table(records), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
