"""pmaptap: device-aware taps for multi-device, multi-host JAX programs."""
from .errors import SessionError, TapError
from .reader import read
from .session import Session, active_session, flush
from .tap import tap

__all__ = sorted([
    "Session",
    "SessionError",
    "TapError",
    "active_session",
    "flush",
    "read",
    "tap",
])
__version__ = "0.1.0"
