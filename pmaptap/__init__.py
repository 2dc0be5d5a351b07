"""pmaptap: device-aware taps for multi-device, multi-host JAX programs."""
from . import host_callback
from .emit import group
from .errors import SessionError, TapError
from .options import configure, configured, options
from .reader import read
from .session import Session, active_session, flush
from .tap import tap
from .tap_grad import tap_grad
from .untapped import untapped

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
