"""What the demo's restarts and faults rest on (launch/train.py): a
checkpoint every few steps, the resume from it, an injected fault (a
process that SIGKILLs itself like a preempted host) for the restart tests,
and a flipped bit in one device's copy of the parameters (``--fault``), the
silent corruption pmaptap.fingerprint names."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, NamedTuple, Sequence

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


class Fault(NamedTuple):
    device: int  # the device id whose copy changes
    step: int  # before this step
    bit: int  # which bit of the first parameter's first element


def parse_fault(text: str) -> Fault:
    """``device=D,step=S[,bit=B]`` (bit 0-31, default 12: a mantissa bit,
    a change of about 1e-4 relative: a loss curve would not show it)."""
    fields = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        if not eq or key.strip() not in ("device", "step", "bit") or not value.strip().isdigit():
            raise ValueError(
                f"--fault {text!r}: expected device=D,step=S[,bit=B] "
                "(non-negative integers), e.g. device=3,step=7"
            )
        fields[key.strip()] = int(value)
    if "device" not in fields or "step" not in fields:
        raise ValueError(f"--fault {text!r}: device= and step= are required, e.g. device=3,step=7")
    fault = Fault(fields["device"], fields["step"], fields.get("bit", 12))
    if fault.bit > 31:
        raise ValueError(f"--fault {text!r}: bit must be 0-31 (of a float32)")
    return fault


def fault_problem(fault: Fault, device_ids: Sequence[int], steps: int) -> str | None:
    """Why ``fault`` cannot happen in this job (a device it does not have, a
    step it never reaches), or None: a fault that never fires would end
    with exit 0 and no suspect, as if the fingerprints had missed it."""
    if fault.device not in device_ids:
        ids = sorted(device_ids)
        have = ", ".join(map(str, ids)) if len(ids) <= 8 else f"{ids[0]}, ..., {ids[-1]}"
        return (
            f"--fault device={fault.device}: this job has no such device "
            f"(its {len(ids)} device(s): {have}). A bare `python launch/train.py` "
            "runs one process on the default devices; run it under the launcher "
            "for more, e.g. python -m pmaptap.launch --processes 2 --devices 4 -- "
            f"python launch/train.py --fault device=3,step={fault.step}"
        )
    if fault.step >= steps:
        return (
            f"--fault step={fault.step}: the job runs steps 0-{steps - 1} "
            f"(--steps {steps}), so the fault would never happen"
        )
    return None


def inject_fault(params: Any, fault: Fault, step: int) -> Any:
    """Before step ``fault.step``: ``params`` with one bit flipped in device
    ``fault.device``'s copy of the first parameter's first element, as a
    corrupted memory or a wrong computation would leave it: nothing in the
    program knows (the process holding that device does it; the others
    leave their copies alone). ``params``: arrays whose shards are the
    devices' copies (pmap's outputs, shard_map's, jit's), or pmap's first
    input, host arrays stacked over the local devices."""
    import jax
    import numpy as np

    if step != fault.step:
        return params
    name = sorted(params)[0]
    value = params[name]
    local = [d.id for d in jax.local_devices()]
    if fault.device not in local:
        return params
    if not isinstance(value, jax.Array):
        host = np.array(value)  # pmap's first step: one row per local device
        row = host[local.index(fault.device)].reshape(-1).view(np.uint32)
        row[0] ^= np.uint32(1 << fault.bit)
        log_all(f"fault: bit {fault.bit} of {name}[0] flipped on device {fault.device}")
        return {**params, name: host}
    shards = []
    for shard in value.addressable_shards:
        data = shard.data
        if shard.device.id == fault.device:
            host = np.array(data)
            host.reshape(-1).view(np.uint32)[0] ^= np.uint32(1 << fault.bit)
            data = jax.device_put(host, shard.device)
        shards.append(data)
    log_all(f"fault: bit {fault.bit} of {name}[0] flipped on device {fault.device}")
    changed = jax.make_array_from_single_device_arrays(value.shape, value.sharding, shards)
    return {**params, name: changed}


def log_all(msg: str) -> None:
    """Print from any process, naming it."""
    import jax

    print(f"[process {jax.process_index()}] {msg}", flush=True)


def log(msg: str) -> None:
    """Print from process 0 only."""
    import jax

    if jax.process_index() == 0:
        print(msg, flush=True)
