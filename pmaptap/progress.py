"""A dependency-free progress bar for multi-process jobs: only process 0
draws it, so N processes sharing one console do not interleave N bars.

    from pmaptap.progress import Progress
    with Progress(total=steps, desc="train") as bar:
        for step in range(steps):
            ...
            bar.update(loss=float(loss))

When it draws (a TTY, ``force``, ``PMAPTAP_PROGRESS``): ``should_draw``,
docs/cli.md. Create it after ``jax.distributed.initialize``: asking JAX
for the process index starts its backend.
"""

from __future__ import annotations

import os
import sys
import time
from typing import IO, Any, Iterable, Iterator, TypeVar

from pmaptap import distributed

T = TypeVar("T")


def should_draw(stream: IO[str], *, force: bool | None = None, process: int | None = None) -> bool:
    """Process 0 only; then a TTY, unless forced (argument or environment)."""
    env = os.environ.get("PMAPTAP_PROGRESS", "").strip()
    if force is None and env in ("0", "1"):
        force = env == "1"
    if force is False:
        return False  # decided without asking JAX anything
    if distributed.process_index(process) != 0:
        return False
    if force:
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real stream
        return False


class Progress:
    """``[#####-----] 5/10  50%  3.1 it/s  loss=0.25`` redrawn in place."""

    def __init__(
        self,
        total: int | None = None,
        *,
        desc: str = "",
        stream: IO[str] | None = None,
        force: bool | None = None,
        process: int | None = None,
        width: int = 30,
        min_interval: float = 0.1,
        unit: str = "it",
    ) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = should_draw(self.stream, force=force, process=process)
        self.width = width
        self.min_interval = min_interval
        self.n = 0
        self.postfix: dict[str, Any] = {}
        self._start = time.monotonic()
        self._last_draw = -float("inf")
        self._last_len = 0
        self.closed = False

    def render(self) -> str:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = f"{self.n / elapsed:.1f} {self.unit}/s"
        head = f"{self.desc}: " if self.desc else ""
        if self.total:
            frac = min(self.n / self.total, 1.0)
            filled = int(round(frac * self.width))
            bar = "#" * filled + "-" * (self.width - filled)
            text = f"{head}[{bar}] {self.n}/{self.total} {frac:4.0%}  {rate}"
        else:
            text = f"{head}{self.n} {self.unit}  {rate}"
        if self.postfix:
            text += "  " + " ".join(f"{k}={_short(v)}" for k, v in self.postfix.items())
        return text

    def _draw(self, final: bool = False) -> None:
        text = self.render()
        # Pad over the previous, possibly longer, line; \r returns to column 0.
        pad = " " * max(self._last_len - len(text), 0)
        self.stream.write("\r" + text + pad + ("\n" if final else ""))
        self.stream.flush()
        self._last_len = len(text)

    def update(self, n: int = 1, **postfix: Any) -> None:
        if not self.enabled or self.closed:
            return
        self.n += n
        self.postfix.update(postfix)
        now = time.monotonic()
        # Throttled: redrawing every step of a fast loop would cost more
        # than the step; the last step is always drawn.
        if now - self._last_draw >= self.min_interval or (
            self.total is not None and self.n >= self.total
        ):
            self._last_draw = now
            self._draw()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.enabled:
            self._draw(final=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def progress(iterable: Iterable[T], total: int | None = None, **kwargs: Any) -> Iterator[T]:
    """Iterate ``iterable`` with a Progress bar (process 0, TTY; see above)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with Progress(total, **kwargs) as bar:
        for item in iterable:
            yield item
            bar.update()
