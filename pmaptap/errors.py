"""Exceptions raised by pmaptap. Each subclasses a built-in so callers can
catch them generically, and each message says what to do about it."""
from __future__ import annotations


class TapError(RuntimeError):
    """A background failure (disk, permissions, lock, dropped records),
    reported at the next ``flush()`` / ``close()`` rather than inside XLA."""

    def __init__(self, message: str, *, path: str | None = None,
                 errors: tuple[BaseException, ...] = ()) -> None:
        super().__init__(message)
        self.path = path
        self.errors = errors


class SessionError(RuntimeError):
    """A session was used in a way its lifecycle does not allow
    (a second open session, flush after close, ...)."""
