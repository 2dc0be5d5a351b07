"""Whether the reading loops run in C: ``SPEEDUPS`` is the compiled module
(pmaptap/tapfile/_speedups.c, built by setup.py where a C compiler is found)
or None, and then the same loops run in Python. ``PMAPTAP_NO_SPEEDUPS=1``
turns it off (the tests run both). Either way a line reads the same: the C
loops are the fast checks only, and hand every unusual line or record to
the Python definitions (parse.parse_line)."""

from __future__ import annotations

import os
from types import ModuleType

SPEEDUPS: ModuleType | None
try:
    from pmaptap.tapfile import _speedups as SPEEDUPS
except ImportError:  # no C compiler at install: the Python loops
    SPEEDUPS = None
if os.environ.get("PMAPTAP_NO_SPEEDUPS"):
    SPEEDUPS = None
