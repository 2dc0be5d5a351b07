"""pmaptap: device-aware taps for multi-device, multi-host JAX programs.

A lazy facade: it names the public API and imports each piece (and JAX) on
first use, so ``pmaptap.tapfile`` and the ``pmaptap`` command read tap files
where JAX is not installed. docs/architecture.md draws the packages
(``_trace``, ``_outputs``, ``_host``, ``tapfile``) and the path of a value.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

# public name -> (module, attribute); attribute None means the module itself.
_PUBLIC: dict[str, tuple[str, str | None]] = {
    "tap": ("pmaptap._trace.tap", "tap"),
    "jit": ("pmaptap._outputs", "jit"),
    "pmap": ("pmaptap._outputs", "pmap"),
    "tap_grad": ("pmaptap._trace.grad", "tap_grad"),
    "fingerprint": ("pmaptap._trace.fingerprint", "fingerprint"),
    "group": ("pmaptap._trace.group", "group"),
    "untapped": ("pmaptap._trace.untapped", "untapped"),
    "configure": ("pmaptap._trace.options", "configure"),
    "configured": ("pmaptap._trace.options", "configured"),
    "options": ("pmaptap._trace.options", "options"),
    "Session": ("pmaptap._host.session", "Session"),
    "active_session": ("pmaptap._host.session", "active_session"),
    "flush": ("pmaptap._host.session", "flush"),
    "read": ("pmaptap.tapfile.read.reader", "read"),
    "assemble": ("pmaptap.tapfile.read.assembly", "assemble"),
    "Writer": ("pmaptap.writer", "Writer"),
    "per_device": ("pmaptap.tapfile.read.frame", "per_device"),
    "TapError": ("pmaptap.errors", "TapError"),
    "TapPathError": ("pmaptap.errors", "TapPathError"),
    "SessionError": ("pmaptap.errors", "SessionError"),
    "host_callback": ("pmaptap.host_callback", None),
    "forwarders": ("pmaptap.forwarders", None),
}
__all__ = sorted(_PUBLIC)
# Public submodules, loaded on first attribute access like the names above, so
# that ``import pmaptap; pmaptap.distributed.initialize()`` works as
# ``jax.distributed.initialize()`` does. Not in __all__: a star import would
# load every one of them (JAX with host_callback, the launcher, the CLI).
# tests/project/test_layout.py checks that this lists every public submodule.
_SUBMODULES = frozenset(
    {
        "cli",
        "distributed",
        "errors",
        "forwarders",
        "host_callback",
        "launch",
        "progress",
        "tapfile",
        "writer",
    }
)


def _package_version() -> str:
    # importlib.metadata costs more than the rest of `pmaptap --help`
    # (tens of ms): looked up on first use of __version__ only.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pmaptap")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        v = globals()["__version__"] = _package_version()
        return v
    if name in _SUBMODULES and name not in _PUBLIC:
        # import_module binds the submodule on this package itself.
        return importlib.import_module(f"pmaptap.{name}")
    try:
        module, attr = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'pmaptap' has no attribute {name!r}") from None
    obj = importlib.import_module(module)
    if attr is not None:
        obj = getattr(obj, attr)
    globals()[name] = obj  # later look-ups skip __getattr__
    return obj


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _SUBMODULES | {"__version__"})


if "jax" in sys.modules:
    # pmaptap.untapped's switch is a JAX configuration state that JAX's jit
    # cache keys include. Registered in the middle of a trace (at the first
    # tap), it would change the key of the very function being traced, whose
    # next call would then trace and compile it again. JAX is loaded already,
    # so registering it now costs no import of JAX (Session.open registers it
    # too, for scripts that import JAX after pmaptap).
    importlib.import_module("pmaptap._common.switch")


if TYPE_CHECKING:  # what type checkers and IDEs see
    from pmaptap import (
        cli,
        distributed,
        errors,
        forwarders,
        host_callback,
        launch,
        progress,
        tapfile,
        writer,
    )
    from pmaptap._host.session import Session, active_session, flush
    from pmaptap._outputs import jit, pmap
    from pmaptap._trace.fingerprint import fingerprint
    from pmaptap._trace.grad import tap_grad
    from pmaptap._trace.group import group
    from pmaptap._trace.options import configure, configured, options
    from pmaptap._trace.tap import tap
    from pmaptap._trace.untapped import untapped
    from pmaptap.errors import SessionError, TapError, TapPathError
    from pmaptap.tapfile.read import assemble, per_device, read
    from pmaptap.writer import Writer
