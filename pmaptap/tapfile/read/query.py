"""The filter every reader and command applies, and its arguments parsed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from pmaptap.tapfile.record import holds


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """``"A:B"`` (inclusive both ends, either side optional) or ``"N"``."""
    try:
        if ":" not in text:
            n = int(text)
            return n, n
        lo, hi = text.split(":", 1)
        a = int(lo) if lo.strip() else None
        b = int(hi) if hi.strip() else None
    except ValueError:
        raise ValueError(
            f"--step wants N, A:B, A: or :B with integers (inclusive), got {text!r}"
        ) from None
    if a is not None and b is not None and a > b:
        # Reversed, so empty: a typo far more often than a real request.
        raise ValueError(
            f"--step {text}: the range is empty ({a} > {b}); "
            f"A:B includes both ends, write {b}:{a} for steps "
            f"{b} to {a}"
        )
    return a, b


@dataclasses.dataclass
class Filter:
    names: tuple[str, ...] = ()
    steps: tuple[int | None, int | None] = (None, None)
    process: int | None = None
    device: int | None = None
    run: str | None = None
    # Show the records that a later attempt of a resumed run superseded too
    # (tapfile/read/attempts.py); by default only the latest attempt's.
    all_attempts: bool = False

    def key_match(self, r: dict) -> bool:
        """The filter on name, run, step: all records of a key or none."""
        if self.names and r.get("name") not in self.names:
            return False
        if self.run is not None and r.get("run") != self.run:
            return False
        lo, hi = self.steps
        step = r.get("step")
        return not (lo is not None and step < lo or hi is not None and step > hi)

    def __call__(self, r: dict) -> bool:
        # Only fields outside ``value``: a record as written (values not
        # decoded yet) matches exactly as its decoded form does.
        if not self.key_match(r):
            return False
        # A replicated record stands for every device/process holding the
        # value (only one process writes it), so it matches any of them.
        if (
            self.process is not None
            and self.process != r.get("process")
            and not holds(r.get("processes"), self.process)
        ):
            return False
        if self.device is not None:
            if r.get("kind") == "per_device":
                return r.get("device") == self.device
            return holds(r.get("devices"), self.device)
        return True

    @property
    def active(self) -> bool:
        unset = ((None, None), None, None, None)
        return bool(self.names) or (self.steps, self.process, self.device, self.run) != unset


def read_filter(name: Any, step: Any, run: Any, device: Any, process: Any) -> Any:
    """read()'s filter arguments as a Filter (None: no filter)."""
    if name is None and step is None and run is None and device is None and process is None:
        return None
    if name is None:
        names: tuple = ()
    elif isinstance(name, str):
        names = (name,)
    else:
        names = tuple(name) if isinstance(name, Iterable) else ()
        if not names or not all(isinstance(n, str) for n in names):
            raise TypeError(
                f"pmaptap.read: name must be a str or a non-empty list of str, got {name!r}"
            )
    steps: tuple = (None, None)
    if isinstance(step, int) and not isinstance(step, bool):
        steps = (step, step)
    elif isinstance(step, str):
        steps = parse_steps(step)
    elif isinstance(step, range):
        if step.step != 1 or len(step) == 0:
            raise ValueError(
                f"pmaptap.read: step={step!r} must be a non-empty "
                "range with step 1 (every=N taps: give (lo, hi))"
            )
        steps = (step.start, step.stop - 1)
    elif (
        isinstance(step, (tuple, list))
        and len(step) == 2
        and all(s is None or (isinstance(s, int) and not isinstance(s, bool)) for s in step)
    ):
        steps = tuple(step)
        if None not in steps and steps[0] > steps[1]:
            raise ValueError(
                f"pmaptap.read: step={step!r} is empty "
                f"({steps[0]} > {steps[1]}); (lo, hi) includes both ends"
            )
    elif step is not None:
        raise TypeError(
            f"pmaptap.read: step must be an int, (lo, hi), 'A:B' or a range, got {step!r}"
        )
    for what, v, kind, text in (
        ("run", run, str, "a str"),
        ("device", device, int, "an int (a device id)"),
        ("process", process, int, "an int"),
    ):
        if v is not None and (not isinstance(v, kind) or isinstance(v, bool)):
            raise TypeError(f"pmaptap.read: {what} must be {text}, got {v!r}")
    return Filter(names=names, steps=steps, process=process, device=device, run=run)
