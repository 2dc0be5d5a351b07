"""pmaptap's own messages go through ``logging``.

- ``logging.getLogger("pmaptap")``: warnings and errors (drops, lock waits,
  close-barrier absentees, truncated or corrupt files, background failures).
  Its level is left to the application (WARNING through the root logger by
  default).
- ``logging.getLogger("pmaptap.console")``: the readable form of records
  tapped while no session is open, at INFO. It is set to INFO here because
  those lines are output the user asked for by tapping; silence them with
  ``logging.getLogger("pmaptap.console").setLevel(logging.WARNING)``.

Visible with no logging configured: a fallback handler on the "pmaptap"
logger writes the bare message to the current ``sys.stderr``, but only while
no other handler would see the record (none on the way from the emitting
logger up to the root, honouring ``propagate``). So once the application
configures logging (``basicConfig``, absl, a handler of its own), messages
go there and only there, never twice. Standard library only: the reading
side (``pmaptap/tapfile``) imports this too.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("pmaptap")
console_log = logging.getLogger("pmaptap.console")


class _Fallback(logging.Handler):
    """``logging.lastResort`` for pmaptap, extended to INFO (console records)."""

    def emit(self, record: logging.LogRecord) -> None:
        if _handled_elsewhere(logging.getLogger(record.name), self):
            return
        try:
            stream = sys.stderr
            if stream is None:  # pythonw, or stderr closed at exit
                return
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own rule: never raise
            self.handleError(record)


def _handled_elsewhere(logger: logging.Logger, me: logging.Handler) -> bool:
    node: logging.Logger | None = logger
    while node is not None:
        if any(h is not me for h in node.handlers):
            return True
        if not node.propagate:
            return False
        node = node.parent  # type: ignore[assignment]
    return False


def _install() -> None:
    if any(isinstance(h, _Fallback) for h in log.handlers):
        return  # a module reload
    handler = _Fallback()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    if console_log.level == logging.NOTSET:
        console_log.setLevel(logging.INFO)


_install()
