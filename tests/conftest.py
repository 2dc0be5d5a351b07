"""Shared test helpers. Every test process sees 8 simulated CPU devices."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# Must happen before jax is imported anywhere in the test process.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def tap_path(tmp_path):
    """A fresh tap file path inside a per-test directory."""
    return str(tmp_path / "taps" / "run.jsonl")


@pytest.fixture
def session(tap_path):
    """An open session on tap_path, closed after the test."""
    import pmaptap
    s = pmaptap.Session(tap_path, run="test").open()
    yield s
    s.close()


def subprocess_env(devices: int = 8, **extra: str) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_python(code: str, *, devices: int = 8, timeout: float = 120,
               check: bool = True, **env: str) -> subprocess.CompletedProcess:
    """Run a dedented Python snippet in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          env=subprocess_env(devices, **env), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n"
                             f"STDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}")
    return proc


def start_python(code: str, *, devices: int = 8, **env: str) -> subprocess.Popen:
    """Start a dedented Python snippet; caller waits/kills."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                            env=subprocess_env(devices, **env), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def by_key(records, *keys):
    """Index records by a tuple of fields (order-independent comparisons)."""
    return {tuple(r.get(k) if not isinstance(r.get(k), dict) else
                  tuple(sorted(r[k].items())) for k in keys): r for r in records}
