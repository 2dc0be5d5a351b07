"""Timing helpers shared by the benchmarks: every arm runs inside one process,
arms interleaved round by round, medians over rounds, and ratios of *added*
cost (arm minus the no-callback baseline) against a raw jax.debug.callback
arm measured in the same run."""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from typing import Callable


def set_devices(n: int) -> None:
    """Must run before jax is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("set_devices() must be called before importing jax")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if "force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def interleaved(arms: dict[str, Callable[[], None]], *, rounds: int,
                steps: int) -> dict[str, float]:
    """Median seconds per step of each arm. Each call of an arm runs `steps`
    steps and must wait for their completion (including host callbacks)."""
    for fn in arms.values():          # warm up: compile, first file writes
        fn()
    times: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(rounds):
        order = list(arms.items())
        if r % 2:
            order.reverse()           # no arm always runs after the same one
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) / steps)
    return {k: statistics.median(v) for k, v in times.items()}


def ratio(med: dict[str, float], arm: str, raw: str, base: str) -> float:
    added_raw = med[raw] - med[base]
    if added_raw <= 0:
        return float("nan")
    return (med[arm] - med[base]) / added_raw


def machine() -> str:
    import jax
    return (f"{platform.machine()} {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, JAX {jax.__version__}, "
            f"{jax.default_backend()} backend")


def table(rows: list[tuple], header: tuple) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    out += [fmt.format(*[str(x) for x in row]) for row in rows]
    return "\n".join(out)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")
