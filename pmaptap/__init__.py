"""pmaptap: device-aware taps for multi-device, multi-host JAX programs."""
from pmaptap import host_callback
from pmaptap._trace.emit import group
from pmaptap.errors import SessionError, TapError
from pmaptap._trace.options import configure, configured, options
from pmaptap.tapfile.reader import read
from pmaptap._host.session import Session, active_session, flush
from pmaptap._trace.tap import tap
from pmaptap._trace.grad import tap_grad
from pmaptap._trace.untapped import untapped

__all__ = sorted([
    "Session",
    "SessionError",
    "TapError",
    "active_session",
    "configure",
    "configured",
    "flush",
    "group",
    "host_callback",
    "options",
    "read",
    "tap",
    "tap_grad",
    "untapped",
])
__version__ = "0.1.0"
