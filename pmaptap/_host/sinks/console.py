"""Taps without a session: one readable line per record on stderr."""

from __future__ import annotations

import logging
from typing import Sequence, TextIO

from pmaptap._host.sinks.base import Sink
from pmaptap._log import console_log
from pmaptap.tapfile.record import FINGERPRINT, Record, encode_line, has_raw, index_text
from pmaptap.tapfile.source import shown_value


def format_console(r: Record) -> str:
    parts = [f"[pmaptap] {r.name} step={r.step} process={r.process}"]
    if r.kind == "per_device":
        parts.append(f"device={r.device}")
        parts.extend(f"{k}={v}" for k, v in (r.coords or {}).items())
    elif r.kind == "replicated":
        parts.append(f"replicas={r.replicas}")
    elif r.kind == FINGERPRINT:
        extra = r.extra or {}
        if extra.get("leaf"):
            parts.append(f"leaf={extra['leaf']}")
        parts.append(f"devices={list(r.devices or ())}")
    if r.index is not None:
        parts.append(f"index=[{index_text(r.index, ', ')}]")
    if r.divergent:
        parts.append("DIVERGENT")
    if r.pass_ != "forward":
        parts.append(f"pass={r.pass_}")
    text = " ".join(parts)
    value = r.value if r.kind != "meta" else r.extra
    if r.kind == FINGERPRINT:
        value = (r.extra or {}).get("fingerprint")
    if r.kind != "meta" and has_raw(value, r.dtype):
        # A big array: its dtype and shape, not megabytes of numbers.
        value = str(shown_value(value, r.dtype, r.shape))
    # Through JSON so NumPy arrays print as plain lists ([0.5, 1.0]).
    shown = encode_line({"v": value}).decode("utf-8").strip()[5:-1]
    if len(shown) > 200:
        shown = shown[:197] + "..."
    return f"{text}: {shown}"


class ConsoleSink(Sink):
    """No open session: one readable line per record, to ``stream`` if given,
    else to the "pmaptap.console" logger (stderr by default)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def write(self, records: Sequence[Record]) -> None:
        if self.stream is not None:
            self.stream.write("".join(format_console(r) + "\n" for r in records))
            self.stream.flush()
            return
        # Through logging (INFO on "pmaptap.console"): on stderr while the
        # application configures nothing, else wherever its handlers send it.
        if console_log.isEnabledFor(logging.INFO):
            for r in records:
                console_log.info(format_console(r))
