"""The session: what ``pmaptap.Session`` opens and closes (session.py), its
run id and resuming (runid.py), and the SIGTERM watcher that acts for a main
thread blocked in C++ (sigterm.py).

The one entry of this sub-package (tests/project/test_layout.py)."""

from pmaptap._host.session.session import Session, active_session, flush

__all__ = ["Session", "active_session", "flush"]
