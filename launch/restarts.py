"""What the demo's restarts rest on (launch/train.py): a checkpoint every
few steps, the resume from it, and an injected fault (a process that
SIGKILLs itself like a preempted host) for the restart tests."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

from model import init_params


def ckpt_path(args: argparse.Namespace) -> str | None:
    return os.path.join(args.ckpt, "ckpt.npz") if args.ckpt else None


def start_params(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """(host parameters, first step): from the checkpoint if there is one,
    else fresh. The parameters are replicated, so a checkpoint written by a
    job of one shape restores on another (an elastic restart)."""
    import numpy as np

    path = ckpt_path(args)
    if path and os.path.exists(path):
        with np.load(path) as z:
            step = int(z["__step__"])
            params = {k: z[k] for k in z.files if k != "__step__"}
        log(f"resuming from {path} at step {step}")
        return params, step
    return init_params(args.seed, args.hidden), 0


def save_checkpoint(
    args: argparse.Namespace, host_params: Callable[[], dict], next_step: int
) -> None:
    """Process 0 writes DIR/ckpt.npz atomically (a restart never reads half
    of one) after a step where ``next_step % --ckpt-every == 0``."""
    import jax
    import numpy as np

    path = ckpt_path(args)
    if not path or next_step % args.ckpt_every or jax.process_index() != 0:
        return
    os.makedirs(args.ckpt, exist_ok=True)
    tmp = path + f".tmp{os.getpid()}.npz"
    np.savez(tmp, __step__=np.int64(next_step), **host_params())
    os.replace(tmp, path)


def maybe_die(args: argparse.Namespace, step: int) -> None:
    """--die-at: the last process dies like a preempted host (SIGKILL, no
    clean-up), after its records so far are written, on the first attempt."""
    import signal

    import jax

    import pmaptap

    if (
        args.die_at != step
        or os.environ.get("PMAPTAP_ATTEMPT", "0") not in ("", "0")
        or jax.process_index() != jax.process_count() - 1
    ):
        return
    pmaptap.flush()
    log(f"process {jax.process_index()} dies at step {step}")
    print(f"dying at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def log(msg: str) -> None:
    """Print from process 0 only."""
    import jax

    if jax.process_index() == 0:
        print(msg, flush=True)
