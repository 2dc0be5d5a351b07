"""What program order costs ``host_callback.id_tap`` (issues 18 and 28).

Two ties (see pmaptap/host_callback/_linked.py): the value ``id_tap``
returns is XORed with an int32 token the callback returns (whatever uses it
waits for the tap), and every tap, print and call of a computation carries
one ordered effect, so JAX threads an XLA token through them (they run in
program order even with no data path between them).

Two loops, each a jitted ``scan`` of LOOP steps on a 4 KiB value:

chain: every step taps the value and feeds the tapped value to the next step
  base       no tap
  raw        jax.debug.callback(noop, y)
  untied     id_tap's callback with neither tie
  unordered  the XOR tie only (id_tap before issue 28)
  tied       id_tap as shipped (XOR tie and token)
independent: every step makes TAPS taps of different values and uses none
of their results (the case the token orders)
  base, unordered, tied   as above

Arms run interleaved in one process; the cost of the token is reported as
the per-round ratio of added costs (tied over unordered, ``paired``), its
median and range over rounds: on a busy machine compare ratios, not times.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (  # noqa: E402
    interleaved_rounds,
    machine,
    main_quick,
    medians,
    round_ratios,
    table,
)

PAYLOAD = 1024  # float32 = 4 KiB
LOOP = 100  # scan steps per call
TAPS = 4  # independent taps per step


def _spread(rs: list[float]) -> str:
    if not rs:
        return "nan"
    rs = sorted(rs)
    return f"{rs[len(rs) // 2]:.2f}x ({rs[0]:.2f}-{rs[-1]:.2f})"


def run(quick: bool = False) -> list[tuple]:
    import jax
    import jax.numpy as jnp
    from jax import lax

    import pmaptap.host_callback as hcb
    from pmaptap.host_callback import _linked, _taps

    rounds, calls = (3, 2) if quick else (15, 10)
    x = jnp.linspace(0.0, 1.0, PAYLOAD, dtype=jnp.float32)

    def noop_tap(arg, transforms):
        return None

    @contextlib.contextmanager
    def variant(kind):
        """The arms' id_tap: the ties are emitted while the function is
        traced and lowered (_taps.linked_tap, as id_tap calls it, binds the ordered effect;
        _linked._xor_token is the XOR), so they are swapped for that time."""
        real_tie, real_bind = _linked._xor_token, _taps.linked_tap
        if kind == "untied":
            _linked._xor_token = lambda value, token: value
        if kind in ("untied", "unordered"):
            _taps.linked_tap = functools.partial(real_bind, ordered=False)
        try:
            yield
        finally:
            _linked._xor_token, _taps.linked_tap = real_tie, real_bind

    def make(kind, independent):
        def step(y, _):
            y = jnp.tanh(y) * 1.0001
            if kind == "raw":
                jax.debug.callback(lambda v: None, y)
            elif kind != "base" and independent:
                for i in range(TAPS):
                    hcb.id_tap(noop_tap, y * (i + 2))
            elif kind != "base":
                y = hcb.id_tap(noop_tap, y)
            return y, None

        def loop(v):
            return lax.scan(step, v, None, length=LOOP)[0]

        with variant(kind):
            return jax.jit(loop).lower(x).compile()  # traced and lowered now

    def arm(fn):
        def go():
            y = None
            for _ in range(calls):
                y = fn(x)
            y.block_until_ready()
            hcb.barrier_wait()

        return go

    chain_kinds = ("base", "raw", "untied", "unordered", "tied")
    chain = interleaved_rounds(
        {k: arm(make(k, False)) for k in chain_kinds}, rounds=rounds, steps=calls
    )
    indep_kinds = ("base", "unordered", "tied")
    indep = interleaved_rounds(
        {k: arm(make(k, True)) for k in indep_kinds}, rounds=rounds, steps=calls
    )
    med, imed = medians(chain), medians(indep)
    per_tap = {k: (med[k] - med["base"]) / LOOP * 1e3 for k in chain_kinds}
    per_step = {k: (imed[k] - imed["base"]) / LOOP * 1e3 for k in indep_kinds}
    rows = [
        (
            "j. id_tap (tied, program order)",
            f"{per_tap['tied']:.4f}",
            f"{_spread(round_ratios(chain, 'tied', 'unordered', 'base'))} of unordered",
        ),
        (
            "j. id_tap, XOR tie only (unordered)",
            f"{per_tap['unordered']:.4f}",
            f"{_spread(round_ratios(chain, 'unordered', 'untied', 'base'))} of untied",
        ),
        ("j. id_tap, callback without the tie", f"{per_tap['untied']:.4f}", "-"),
        ("j. raw jax.debug.callback", f"{per_tap['raw']:.4f}", "-"),
        (
            f"j. {TAPS} independent id_taps (ordered)",
            f"{per_step['tied']:.4f}",
            f"{_spread(round_ratios(indep, 'tied', 'unordered', 'base'))} of unordered",
        ),
        (
            f"j. {TAPS} independent id_taps (unordered)",
            f"{per_step['unordered']:.4f}",
            "-",
        ),
    ]
    print(
        f"jit(scan) of {LOOP} steps, {PAYLOAD * 4 // 1024} KiB per tap; no-tap step "
        f"{med['base'] / LOOP * 1e3:.4f} ms; {rounds} rounds; {machine()}"
    )
    print(
        table(
            rows,
            ("arm", "added ms per step", "added cost: median ratio (range over rounds)"),
        )
    )
    return rows


if __name__ == "__main__":
    main_quick(run, 1)
