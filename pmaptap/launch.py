"""Run a multi-process JAX job on this machine (docs/multihost.md, "Try it
on one machine").

    python -m pmaptap.launch --processes 2 --devices 4 [--timeout S] [--grace G] \\
        -- python launch/train.py --steps 20

P copies of the command, each with D simulated CPU devices and the
``PMAPTAP_*`` variables ``pmaptap.distributed.initialize()`` connects with;
output prefixed ``[p0] ``, ``[p1] ``, ... A child that fails or dies: the
others get SIGTERM, then SIGKILL after ``--grace`` seconds, and the launcher
exits with that child's status (128 + signal for a signal). ``--timeout``:
the same to all after S seconds (exit 124); SIGINT / SIGTERM to the
launcher are forwarded (exit 130 / 143). Every child leads its own process
group, so whatever it started is stopped with it.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Sequence

from pmaptap.distributed import (
    ENV_COORDINATOR,
    ENV_COORDINATOR_BIND,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

EXIT_TIMEOUT = 124
_POLL = 0.05


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def child_env(
    process_id: int, processes: int, devices: int, port: int, base: dict[str, str] | None = None
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    # Replace (not append to) any device count the caller had set.
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")
    ).split()
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    address = f"127.0.0.1:{port}"
    env[ENV_COORDINATOR] = address
    # Listen on loopback only; JAX's default is every interface ([::]:port).
    env[ENV_COORDINATOR_BIND] = address
    env[ENV_NUM_PROCESSES] = str(processes)
    env[ENV_PROCESS_ID] = str(process_id)
    env["PYTHONUNBUFFERED"] = "1"  # lines reach us as they are printed
    # Children write to our pipes, never a terminal: let process 0 draw its
    # progress bar when our own stderr is one (the forwarder passes "\r").
    if "PMAPTAP_PROGRESS" not in env and _stderr_is_tty():
        env["PMAPTAP_PROGRESS"] = "1"
    return env


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


# Printed by gloo (CPU collectives) for every device pair at start-up; it
# buries the job's own output and says nothing a user can act on.
# Several gloo threads write at once, so a line may arrive torn: match the
# tail that every such line ends with.
_NOISE = b"connected peer ranks"
# What gloo prints when it aborts a process: a collective of the process
# failed (a peer died in the middle of a step, so the process's own devices
# fell out of step with each other). It reads like a bug in the job's code;
# the launcher says what it is, once per process and attempt.
_GLOO_ABORT = b"gloo::EnforceNotMet"
# What is left of a chatter line once another thread's write tore it: digits,
# spaces and punctuation, then the line's end.
_FRAGMENT = re.compile(rb"[0-9 .:]*\r?\n")
# The pieces a chatter line is written in: "[Gloo] Rank 0 is connected to 3
# peer ranks. Expected number of connected peer ranks is : 3".
_CHATTER = re.compile(
    rb"\[Gloo\] Rank \d* ?|is connected to \d* ?|peer ranks\. ?"
    rb"|Expected number of connected peer ranks is : ?\d*"
)


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class _Forwarder(threading.Thread):
    """Copies one child stream to ours, a whole prefixed line at a time."""

    def __init__(
        self,
        src: IO[bytes],
        dst: IO[bytes],
        prefix: bytes,
        lock: threading.Lock,
        on_gloo_abort: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(daemon=True, name=f"forward-{prefix!r}")
        self.src, self.dst, self.prefix, self.lock = src, dst, prefix, lock
        self.on_gloo_abort = on_gloo_abort
        self.after_noise = False  # the last segment was gloo's chatter

    def run(self) -> None:
        # Split on "\n" and on "\r": a progress bar redrawn in place with
        # "\r" reaches the terminal as it is drawn, each redraw re-prefixed.
        buf = b""
        try:
            while True:
                chunk = self.src.read1(65536)
                if not chunk:
                    break
                buf += chunk
                while True:
                    cut = [i for i in (buf.find(b"\n"), buf.find(b"\r")) if i >= 0]
                    if not cut:
                        break
                    i = min(cut)
                    end = i + (2 if buf[i : i + 2] == b"\r\n" else 1)
                    self._emit(buf[:end])
                    buf = buf[end:]
            if buf:
                self._emit(buf + b"\n")
        except (OSError, ValueError):
            pass
        finally:
            try:
                self.src.close()
            except OSError:
                pass

    def _emit(self, segment: bytes) -> None:
        after_noise, self.after_noise = self.after_noise, _NOISE in segment
        if self.after_noise:
            # gloo's per-rank chatter, written a piece at a time by several
            # threads: a job's line written meanwhile lands inside it, and is
            # what is left once the chatter's pieces are taken out.
            segment = _CHATTER.sub(b"", segment)
            if not segment.strip() or _FRAGMENT.fullmatch(segment):
                return
        elif segment == b"\r":
            return  # a bare "\r" would print a lone prefix
        elif after_noise and _FRAGMENT.fullmatch(segment):
            # The tail of a chatter line torn by another gloo thread's (its
            # count, its newline): seen as a lone "[p0] " line in a job's
            # output. One per chatter line: what follows is the job's again.
            return
        with self.lock:
            try:
                self.dst.write(self.prefix + segment)
                self.dst.flush()
            except (OSError, ValueError):
                pass  # our own output closed: keep draining the pipe
        if _GLOO_ABORT in segment and self.on_gloo_abort is not None:
            self.on_gloo_abort()
            self.on_gloo_abort = None  # once


class Launcher:
    def __init__(
        self,
        command: Sequence[str],
        *,
        processes: int,
        devices: int,
        timeout: float | None = None,
        grace: float = 5.0,
        stdout: IO[bytes] | None = None,
        stderr: IO[bytes] | None = None,
        restarts: int = 0,
    ) -> None:
        self.command = list(command)
        self.restarts = restarts
        self.attempt = 0
        self.processes = processes
        self.devices = devices
        self.timeout = timeout
        self.grace = grace
        self.stdout = stdout or sys.stdout.buffer
        self.stderr = stderr or sys.stderr.buffer
        self._lock = threading.Lock()
        self.children: list[subprocess.Popen] = []
        self._forwarders: list[_Forwarder] = []
        self._signal: int | None = None

    def say(self, msg: str) -> None:
        with self._lock:
            try:
                self.stderr.write(f"[launch] {msg}\n".encode())
                self.stderr.flush()
            except (OSError, ValueError):
                pass

    # ------------------------------------------------------------ start
    def start(self) -> None:
        port = free_port()
        for i in range(self.processes):
            env = child_env(i, self.processes, self.devices, port)
            if self.restarts:
                # Session(resume=True) continues the run as this attempt.
                env["PMAPTAP_ATTEMPT"] = str(self.attempt)
            try:
                child = subprocess.Popen(
                    self.command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )  # own process group (see stop)
            except OSError as e:
                self.stop_all(signal.SIGTERM)
                raise SystemExit(f"[launch] cannot start {self.command[0]!r}: {e}") from None
            self.children.append(child)
            prefix = f"[p{i}] ".encode()
            for src, dst in ((child.stdout, self.stdout), (child.stderr, self.stderr)):
                f = _Forwarder(src, dst, prefix, self._lock, functools.partial(self._gloo_note, i))
                f.start()
                self._forwarders.append(f)

    def _gloo_note(self, process: int) -> None:
        self.say(
            f"process {process} was aborted by gloo (the CPU collectives): one of "
            "its cross-process collectives failed, as happens when another process "
            "dies in the middle of a step; not a bug in the job "
            "(docs/multihost.md#preemption-and-restarts)"
        )

    # ------------------------------------------------------------ stop
    def _signal_groups(self, sig: int, only_running: bool) -> None:
        for child in self.children:
            if only_running and child.poll() is not None:
                continue
            try:
                os.killpg(child.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop_all(self, first: int = signal.SIGTERM) -> None:
        """``first`` to every running child's group, SIGKILL after the grace
        period, then SIGKILL to any straggler left in the groups."""
        self._signal_groups(first, only_running=True)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(c.poll() is None for c in self.children):
            time.sleep(_POLL)
        survivors = [i for i, c in enumerate(self.children) if c.poll() is None]
        if survivors:
            self.say(
                f"process(es) {', '.join(map(str, survivors))} still "
                f"running after {self.grace:g}s; sending SIGKILL"
            )
        self._signal_groups(signal.SIGKILL, only_running=False)
        for c in self.children:
            try:
                c.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable
                self.say(f"pid {c.pid} did not die after SIGKILL")

    # ------------------------------------------------------------ run
    def _on_signal(self, signum: int, frame) -> None:
        self._signal = signum

    def run(self) -> int:
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            while True:
                self.start()
                rc = self._wait()
                if (
                    rc == 0
                    or self._signal is not None
                    or rc == EXIT_TIMEOUT
                    or self.attempt >= self.restarts
                ):
                    return rc
                # A process failed and the job was stopped: start it again,
                # every process, on a fresh port (the training script
                # resumes from its checkpoint).
                self.attempt += 1
                self.say(
                    f"restarting the job (attempt {self.attempt} of {self.restarts} restart(s))"
                )
                for f in self._forwarders:
                    f.join(timeout=2)
                self.children, self._forwarders = [], []
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for f in self._forwarders:
                f.join(timeout=2)

    def _wait(self) -> int:
        started = time.monotonic()
        while True:
            if self._signal is not None:
                name = signal.Signals(self._signal).name
                self.say(f"received {name}; stopping all processes")
                self.stop_all(self._signal)
                return 128 + self._signal
            codes = [c.poll() for c in self.children]
            failed = [(i, rc) for i, rc in enumerate(codes) if rc is not None and rc != 0]
            if failed:
                i, rc = failed[0]
                running = [j for j, r in enumerate(codes) if r is None]
                self.say(
                    f"process {i} {_describe(rc)}"
                    + (f"; stopping process(es) {', '.join(map(str, running))}" if running else "")
                )
                self.stop_all(signal.SIGTERM)
                return _exit_status(rc)
            if all(rc == 0 for rc in codes):
                # Leave nothing behind that a child started and forgot.
                self._signal_groups(signal.SIGKILL, only_running=False)
                return 0
            if self.timeout is not None and time.monotonic() - started > self.timeout:
                self.say(f"timeout after {self.timeout:g}s; stopping all processes")
                self.stop_all(signal.SIGTERM)
                return EXIT_TIMEOUT
            time.sleep(_POLL)


def parse_args(argv: Sequence[str], prog: str = "python -m pmaptap.launch") -> argparse.Namespace:
    argv = list(argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run P processes x D simulated CPU devices of one JAX job "
        "on this machine, connected through jax.distributed on a "
        "loopback port.",
        epilog=f"example: {prog} --processes 2 --devices 4 -- python launch/train.py --steps 20",
    )
    p.add_argument(
        "--processes",
        "-p",
        type=int,
        required=True,
        help="number of processes (jax.process_count())",
    )
    p.add_argument(
        "--devices", "-d", type=int, required=True, help="simulated CPU devices per process"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="stop everything after S seconds (exit status 124)",
    )
    p.add_argument(
        "--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL (default 5)"
    )
    p.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="K",
        help="when a process fails, stop the job and start it "
        "again, up to K times; each start gets PMAPTAP_ATTEMPT "
        "(0, 1, ...) so that Session(resume=True) continues "
        "the run",
    )
    args = p.parse_args(argv)
    if not command:
        p.error("give the command after '--', e.g. -- python train.py")
    if args.processes < 1 or args.devices < 1:
        p.error("--processes and --devices must be >= 1")
    if args.timeout is not None and args.timeout <= 0:
        p.error("--timeout must be > 0")
    if args.grace < 0:
        p.error("--grace must be >= 0")
    if args.restarts < 0:
        p.error("--restarts must be >= 0")
    args.command = command
    return args


def main(argv: Sequence[str] | None = None, prog: str = "python -m pmaptap.launch") -> int:
    """Entry point of ``python -m pmaptap.launch`` (and ``pmaptap launch``,
    which passes its own ``prog``). Returns the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv, prog)
    return Launcher(
        args.command,
        processes=args.processes,
        devices=args.devices,
        timeout=args.timeout,
        grace=args.grace,
        restarts=args.restarts,
    ).run()


if __name__ == "__main__":
    sys.exit(main())
