"""The one compiled part of pmaptap: the reading loops of pmaptap.tapfile in
C (pmaptap/tapfile/_speedups.c). Optional: where no C compiler is found the
build goes on without it and the same loops run in Python
(pmaptap/tapfile/speedups.py). Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pmaptap.tapfile._speedups",
            ["pmaptap/tapfile/_speedups.c"],
            optional=True,
        )
    ]
)
