"""The tap-file format and everything that reads it (never imports JAX):
five sub-packages, layers ``record``, ``source``, ``read``, ``analyze`` and
``export``, each importing only the ones before it and only through their
``__init__`` (docs/architecture.md; tests/project/test_layout.py)."""

from __future__ import annotations

import importlib
from typing import Any

# The sub-packages, loaded on first attribute access (as the pmaptap
# package does for its own submodules).
_SUBMODULES = frozenset({"analyze", "export", "read", "record", "source"})

# The modules docs/api.md names as ``pmaptap.tapfile.<module>``, where they
# lived before the sub-packages.
_DOCUMENTED = {
    "reader": "read.reader",
    "views": "read.views",
    "follow": "read.follower",
    "frame": "read.frame",
    "checks": "analyze.validate",
    "summary": "analyze.summary",
    "fingerprints": "analyze.fingerprints",
    "tensorboard": "export.tensorboard",
    "plot": "export.plot",
    "arrays": "source.arrays",
}


def loaded_on_use(package: str, homes: dict[str, str], *, attribute: bool) -> Any:
    """A module ``__getattr__`` for ``package``: a name in ``homes`` is the
    module below ``package`` named there, or (with ``attribute``) that
    module's attribute of the name, read at each use."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        # import_module binds a sub-package on this package itself.
        module = importlib.import_module(f"{package}.{homes[name]}")
        return getattr(module, name) if attribute else module

    return __getattr__


__getattr__ = loaded_on_use(
    __name__, {**{s: s for s in _SUBMODULES}, **_DOCUMENTED}, attribute=False
)


def __dir__() -> list[str]:
    return sorted(set(globals()) | _SUBMODULES | set(_DOCUMENTED))
