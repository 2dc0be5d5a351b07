"""The tap-file format and everything that reads it (never imports JAX).

Five sub-packages, each a layer that imports only the ones before it and
only through their ``__init__`` (tests/project/test_layout.py checks both):

- ``record``: the record format, once (fields, line encoding, parsing,
  raw arrays);
- ``source``: a path resolved once into a ``Run`` (one file, a sharded
  directory or an object-store URL), its lines and stored array bytes;
- ``read``: records, queries, attempts, divergence, views, frames,
  assembled arrays and following a growing run;
- ``analyze``: summary, validate, fingerprints and the parallel workers;
- ``export``: CSV, TensorBoard, plots and merging shards.
"""

from __future__ import annotations

import importlib
from typing import Any

# The sub-packages, loaded on first attribute access, so that
# ``import pmaptap; pmaptap.tapfile.read.read(path)`` works without an
# import of each (as the pmaptap package does for its own submodules).
# tests/project/test_layout.py checks that this lists every one here.
_SUBMODULES = frozenset({"analyze", "export", "read", "record", "source"})

# The reader modules docs/api.md names as ``pmaptap.tapfile.<module>``,
# where they lived before the sub-packages: still attributes of the package.
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


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        # import_module binds the sub-package on this package itself.
        return importlib.import_module(f"{__name__}.{name}")
    if name in _DOCUMENTED:
        return importlib.import_module(f"{__name__}.{_DOCUMENTED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _SUBMODULES | set(_DOCUMENTED))
