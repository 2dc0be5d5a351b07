"""pmaptap's own messages go through ``logging``: the "pmaptap" logger
(warnings and errors, level left to the application) and "pmaptap.console"
(records tapped while no session is open, set to INFO here because those
lines are output the user asked for); docs/api.md, "Logging".

The fallback handler on "pmaptap" writes the bare message to the current
``sys.stderr`` only while no other handler would see the record (none on
the way up to the root, honouring ``propagate``): once the application
configures logging, messages go there and only there, never twice.
Standard library only: the reading side (``pmaptap/tapfile``) imports this.
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
