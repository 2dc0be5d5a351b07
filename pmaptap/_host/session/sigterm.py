"""SIGTERM wherever the main thread is: a watcher thread, reading the
``signal.set_wakeup_fd`` socket, hands it to the open session
(``Session._sigterm_from_watcher``) when the main thread is blocked in C++.
Why, and why a datagram pair with ``SO_PASSCRED``: docs/faults.md (the
SIGTERM rows, and a forked child's SIGTERM before its at-fork hook ran).
One watcher per process, started with the first session opened on the main
thread (``set_wakeup_fd`` may only be called there); a forked child drops it.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading

from pmaptap._log import log

_lock = threading.Lock()
_watcher: "_Watcher | None" = None


_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


class _Watcher:
    def __init__(self) -> None:
        self.rsock, self.wsock, self.creds = _socket_pair()
        # set_wakeup_fd wants a non-blocking descriptor: the C handler must
        # never block (a full buffer drops the byte, and one byte is enough).
        self.wsock.setblocking(False)
        self.previous = signal.set_wakeup_fd(self.wsock.fileno(), warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self._run, daemon=True, name="pmaptap-sigterm")
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                if self.creds:
                    data, anc, _, _ = self.rsock.recvmsg(512, socket.CMSG_SPACE(_UCRED.size))
                    if _sender(anc) not in (None, os.getpid()):
                        continue  # a forked child's signal, not ours
                else:
                    data = self.rsock.recv(512)
            except OSError:
                return
            if not data:
                return
            if self.previous != -1:
                try:
                    os.write(self.previous, data)
                except OSError:
                    pass  # theirs is full or closed: as if we were not here
            if signal.SIGTERM in data:
                _hand_over()


def _socket_pair() -> tuple[socket.socket, socket.socket, bool]:
    """(read end, write end, whether reads carry the writer's pid)."""
    try:
        r, w = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    except (AttributeError, OSError):
        r, w = socket.socketpair()
        return r, w, False
    try:
        r.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    except (AttributeError, OSError):  # not Linux: no pid to check
        return r, w, False
    return r, w, True


def _sender(anc: list) -> int | None:
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            if len(data) >= _UCRED.size:
                return _UCRED.unpack_from(data)[0]
    return None


def _hand_over() -> None:
    from pmaptap._host import routing

    s = routing.active_session()
    if s is None:
        return  # no session open: the handler that runs is not ours
    try:
        s._sigterm_from_watcher()
    except BaseException as e:  # noqa: BLE001 - a daemon thread: say it, go on
        log.error(f"[pmaptap] error while acting on SIGTERM: {e!r}")


def install() -> bool:
    """Start the watcher (once per process; main thread only). False where
    it cannot be (not the main thread, a platform without wakeup fds)."""
    global _watcher
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        if _watcher is not None:
            return True
        try:
            _watcher = _Watcher()
        except (ValueError, OSError) as e:
            log.debug(f"pmaptap: no SIGTERM watcher ({e})")
            return False
        return True


def die_by_sigterm() -> None:
    """End this process by SIGTERM's default action, from any thread.

    ``signal.signal`` may only be called on the main thread, and the main
    thread is the one that cannot run (that is why the watcher acts), so the
    C-level disposition is reset through libc. If that is not possible the
    process exits with the status a SIGTERM death reports to a shell."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(int(signal.SIGTERM), None)  # SIG_DFL is the null handler
        os.kill(os.getpid(), signal.SIGTERM)
    except Exception:  # noqa: BLE001
        pass
    os._exit(128 + int(signal.SIGTERM))


def _after_fork_in_child() -> None:
    global _watcher, _lock
    _lock = threading.Lock()
    w, _watcher = _watcher, None
    if w is None:
        return
    try:
        # The child's main thread is the one that forked: allowed here.
        signal.set_wakeup_fd(w.previous)
    except (ValueError, OSError):
        pass
    for s in (w.rsock, w.wsock):
        try:
            s.close()
        except OSError:
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)
