"""The tap-file format and everything that reads it (never imports JAX)."""

from __future__ import annotations

import importlib
from typing import Any

# The modules of this package, loaded on first attribute access, so that
# ``import pmaptap; pmaptap.tapfile.reader.read(path)`` works without an
# import of each (as the pmaptap package does for its own submodules).
# tests/project/test_layout.py checks that this lists every module here.
_SUBMODULES = frozenset(
    {
        "arrays",
        "assemble",
        "attempts",
        "checks",
        "divergence",
        "export",
        "fingerprints",
        "follow",
        "format",
        "frame",
        "jobs",
        "lines",
        "merge",
        "parse",
        "plot",
        "query",
        "rawarray",
        "reader",
        "runs",
        "schema",
        "shardwise",
        "store",
        "stream",
        "summary",
        "summary_table",
        "tensorboard",
        "views",
    }
)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        # import_module binds the submodule on this package itself.
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _SUBMODULES)
