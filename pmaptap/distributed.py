"""Multi-process jobs: connecting the processes, agreeing on the run id, and
the coordinated close (docs/multihost.md).

``initialize()`` comes before any JAX computation
(``jax.distributed.initialize`` refuses once a backend exists). Under
``python -m pmaptap.launch`` it connects with exactly the launcher's
settings, JAX's cluster detection off so a surrounding SLURM allocation
cannot interfere; on a cluster JAX knows (or with
``JAX_COORDINATOR_ADDRESS``) through JAX's detection; a lone process does
nothing.

Run-id agreement and the close barrier use the key-value store and barriers
of JAX's coordination service (``jax._src.distributed.global_state.client``),
never device collectives: they work while devices are busy or wedged, and a
dead peer costs a bounded timeout, not a hang.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

from pmaptap._log import log
from pmaptap.errors import DistributedError

# Set by the launcher (and usable by hand, e.g. in a Kubernetes Job).
ENV_COORDINATOR = "PMAPTAP_COORDINATOR"  # host:port of process 0
ENV_COORDINATOR_BIND = "PMAPTAP_COORDINATOR_BIND"  # where process 0 listens
ENV_NUM_PROCESSES = "PMAPTAP_NUM_PROCESSES"
ENV_PROCESS_ID = "PMAPTAP_PROCESS_ID"
ENV_INIT_TIMEOUT = "PMAPTAP_INIT_TIMEOUT"  # seconds to connect (default 120)
ENV_RUN_ID_TIMEOUT = "PMAPTAP_RUN_ID_TIMEOUT"  # seconds to wait for process 0's id

# Environment variables by which JAX's own cluster detection
# (jax._src.clusters) recognises a job; all must be set and non-empty.
_CLUSTER_MARKERS: dict[str, tuple[str, ...]] = {
    "SLURM": (
        "SLURM_JOB_ID",
        "SLURM_NTASKS",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_STEP_NODELIST",
    ),
    "Open MPI": ("OMPI_MCA_orte_hnp_uri",),
    # Every pod has KUBERNETES_SERVICE_HOST; only an Indexed Job is a job.
    "Kubernetes": ("KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX"),
    "Cloud TPU": ("TPU_WORKER_HOSTNAMES",),
    "Cloud TPU (Megascale)": ("MEGASCALE_COORDINATOR_ADDRESS",),
}
# Which python module JAX needs for a detector (absent: JAX cannot detect).
_CLUSTER_NEEDS = {"Kubernetes": "kubernetes"}

_state_lock = threading.Lock()
# agree(): how many times each topic was asked in this process.
_agree_calls: dict[str, int] = {}
# True in a process forked from a job's process: the coordination client is
# the parent's (its key-value calls and barriers would speak for the parent),
# so a forked child acts as a job of one process.
_forked = False


def _after_fork_in_child() -> None:
    global _forked, _state_lock
    _forked = True
    _state_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
_close_calls: dict[str, int] = {}
_open_calls: dict[tuple[str, int], int] = {}
_mode: str | None = None
# warn_if_launched_alone has looked (once a process).
_alone_checked = False


def launcher_settings(
    environ: dict[str, str] | None = None,
) -> tuple[str, int, int, str | None] | None:
    """(coordinator, num_processes, process_id, bind) from PMAPTAP_* or None."""
    env = os.environ if environ is None else environ
    coord = env.get(ENV_COORDINATOR)
    if not coord:
        return None
    try:
        n = int(env[ENV_NUM_PROCESSES])
        pid = int(env[ENV_PROCESS_ID])
    except (KeyError, ValueError) as e:
        raise DistributedError(
            f"{ENV_COORDINATOR}={coord!r} is set, so {ENV_NUM_PROCESSES} and "
            f"{ENV_PROCESS_ID} must be integers too ({e!r}). Start the job "
            "with `python -m pmaptap.launch`, or unset "
            f"{ENV_COORDINATOR}."
        ) from None
    if not 0 <= pid < n:
        raise DistributedError(f"{ENV_PROCESS_ID}={pid} must be in [0, {ENV_NUM_PROCESSES}={n}).")
    return coord, n, pid, env.get(ENV_COORDINATOR_BIND) or None


def detect_cluster(environ: dict[str, str] | None = None) -> tuple[str, str | None] | None:
    """(name, jax cluster_detection_method or None) of the cluster environment
    this process runs in, or None for a lone process.

    A SLURM allocation with a single task counts as a lone process (there is
    nobody to connect to). Open MPI 5 / other MPIs without the variable JAX
    looks for are handled through mpi4py when it is installed."""
    from importlib.util import find_spec

    env = os.environ if environ is None else environ
    for name, keys in _CLUSTER_MARKERS.items():
        if not all(env.get(k) for k in keys):
            continue
        if name == "SLURM" and env.get("SLURM_NTASKS") == "1":
            continue
        need = _CLUSTER_NEEDS.get(name)
        if need and find_spec(need) is None:
            log.warning(
                f"pmaptap: {name} job detected but JAX needs the "
                f"{need!r} package to bootstrap it (pip install "
                f"'jax[k8s]'); or set {ENV_COORDINATOR}, "
                f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} "
                "(see launch/k8s-indexed-job.yaml). Running alone."
            )
            return None
        return name, None
    size = env.get("OMPI_COMM_WORLD_SIZE") or env.get("PMI_SIZE")
    if size and size.isdigit() and int(size) > 1 and find_spec("mpi4py"):
        return "MPI (mpi4py)", "mpi4py"
    return None


def _cpu_platform() -> bool:
    """Whether the default JAX platform will be CPU, decided without creating
    a backend (that would make jax.distributed.initialize refuse)."""
    platforms = os.environ.get("JAX_PLATFORMS") or ""
    if not platforms:
        import jax

        platforms = jax.config.jax_platforms or ""
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    from importlib.util import find_spec

    accel = (
        "jax_cuda12_plugin",
        "jax_cuda13_plugin",
        "jax_rocm60_plugin",
        "jax_rocm7_plugin",
        "libtpu",
    )
    return not any(find_spec(m) is not None for m in accel)


def _use_gloo_on_cpu() -> None:
    # Cross-process collectives (pmean over all hosts' devices) on the CPU
    # backend need an implementation; JAX reads this when it creates the CPU
    # client, i.e. after initialize. An explicit user choice wins.
    if os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        return
    if _cpu_platform():
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def initialize(
    *,
    initialization_timeout: int | None = None,
    heartbeat_timeout_seconds: int = 100,
    shutdown_timeout_seconds: int = 60,
) -> str:
    """Connect this process to its job, if it is part of one.

    Returns the mode used: "launcher", "cluster:<name>", "single" (lone
    process, nothing done) or "already" (jax.distributed was initialized
    before). Call it first thing in the script, before any JAX computation
    and before opening a pmaptap.Session.
    """
    global _mode
    import jax
    from jax._src import distributed as jdist
    from jax._src import xla_bridge

    with _state_lock:
        if jdist.global_state.client is not None:
            _mode = _mode or "already"
            return _mode
        settings = launcher_settings()
        cluster = None if settings else detect_cluster()
        if settings is None and cluster is None:
            _mode = "single"
            return _mode
        if xla_bridge.backends_are_initialized():
            raise DistributedError(
                "pmaptap.distributed.initialize() was called after JAX created "
                "its backend (some JAX computation, jax.devices(), or "
                "pmaptap.Session.open() ran first). Call it at the very top of "
                "the script, right after the imports."
            )
        if initialization_timeout is None:
            initialization_timeout = int(os.environ.get(ENV_INIT_TIMEOUT, "120"))
        _use_gloo_on_cpu()
        if settings is not None:
            coord, n, pid, bind = settings
            jax.distributed.initialize(
                coordinator_address=coord,
                num_processes=n,
                process_id=pid,
                # Our settings are complete: keep JAX from filling gaps from
                # a SLURM/MPI environment the launcher happens to run in.
                cluster_detection_method="deactivate",
                initialization_timeout=initialization_timeout,
                heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                shutdown_timeout_seconds=shutdown_timeout_seconds,
                coordinator_bind_address=bind,
            )
            _mode = "launcher"
        else:
            name, method = cluster
            jax.distributed.initialize(
                cluster_detection_method=method,
                initialization_timeout=initialization_timeout,
                heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                shutdown_timeout_seconds=shutdown_timeout_seconds,
            )
            _mode = f"cluster:{name}"
        return _mode


def warn_if_launched_alone() -> None:
    """Say once (pmaptap's logger) that this process was started by
    ``pmaptap launch`` for a job of several processes but never connected to
    it: without ``initialize()`` JAX sees one process, so every process
    writes a run of its own, each labelled process 0, and nothing else says
    so. Called where a session opens and where a tap is traced: cheap after
    the first call."""
    global _alone_checked
    if _alone_checked:
        return
    if _client() is None:
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized():
            # Not yet: asking JAX now would start its backend, and an
            # initialize() still to come would be refused for it.
            return
    _alone_checked = True
    if _client() is not None:
        return
    try:
        settings = launcher_settings()
    except DistributedError:
        return  # malformed: initialize() says so where it is called
    if settings is None or settings[1] < 2:
        return
    import jax

    if jax.process_count() > 1:
        return  # connected some other way (jax.distributed by hand)
    _, n, pid, _ = settings
    log.warning(
        f"pmaptap: this process was started by `pmaptap launch` as process {pid} of "
        f"{n} ({ENV_PROCESS_ID}={pid}, {ENV_NUM_PROCESSES}={n}), but JAX sees 1 "
        "process: pmaptap.distributed.initialize() was not called. Each process "
        "now writes a run of its own, every one labelled process 0. Call "
        "pmaptap.distributed.initialize() first thing in the script, before any "
        "JAX computation."
    )


# --------------------------------------------------------------- helpers


def _client() -> Any | None:
    """The coordination-service client, or None outside a multi-process job
    (and in a forked child, which must not speak for its parent)."""
    if _forked:
        return None
    try:
        from jax._src import distributed as jdist
    except ImportError:  # pragma: no cover - JAX layout changed
        return None
    return jdist.global_state.client


def process_index(process: int | None = None) -> int:
    """``process``, or where None this process's index in the JAX job."""
    if process is not None:
        return int(process)
    import jax

    return jax.process_index()


def _process_info() -> tuple[int, int]:
    from jax._src import distributed as jdist

    st = jdist.global_state
    n = st.num_processes
    pid = st.process_id
    if n is None:  # pragma: no cover - older JAX without the attribute
        import jax

        n, pid = jax.process_count(), jax.process_index()
    return int(n), int(pid)


def _multi_process() -> bool:
    if _client() is None:
        return False
    try:
        return _process_info()[0] > 1
    except Exception:  # noqa: BLE001
        return False


# --------------------------------------------------------------- run id


def agree_run_id(make: Callable[[], str], *, timeout: float | None = None) -> str | None:
    """The run id shared by every process of the job, or None when alone.

    The k-th call on each process is paired with the k-th call on the others
    (sessions are opened in the same order everywhere): process 0 proposes
    ``make()`` under key ``pmaptap/run_id/<k>``, the others read it. If
    process 0 does not publish in time, this process uses its own id and
    warns (its records then carry a different run).
    """
    return agree("run_id", make, timeout=timeout)


def agree(topic: str, make: Callable[[], str], *, timeout: float | None = None) -> str | None:
    """``agree_run_id`` for any text process 0 decides (``topic`` names
    what; its calls are paired k-th with k-th on their own, so one kind of
    question never takes another's answer)."""
    client = _client()
    if client is None or not _multi_process():
        return None
    n, pid = _process_info()
    with _state_lock:
        k = _agree_calls.get(topic, 0)
        _agree_calls[topic] = k + 1
    key = f"pmaptap/{topic}/{k}"
    what = "the run id" if topic == "run_id" else f"its answer ({topic})"
    if pid == 0:
        run = make()
        try:
            client.key_value_set(key, run)
        except Exception as e:  # noqa: BLE001
            log.warning(
                f"pmaptap: could not publish {what} {run!r} to "
                f"the other processes ({e}); they will decide on their own."
            )
        return run
    if timeout is None:
        timeout = float(os.environ.get(ENV_RUN_ID_TIMEOUT, "120"))
    try:
        return client.blocking_key_value_get(key, int(timeout * 1000))
    except Exception as e:  # noqa: BLE001
        own = make()
        log.warning(
            f"pmaptap: process {pid} did not receive {what} from process 0 "
            f"within {timeout:.0f}s ({type(e).__name__}: {e}); using {own!r}. "
            "Open the Session on every process (process 0 included), or pass "
            "the same Session(run=...) / PMAPTAP_RUN everywhere."
        )
        return own


def session_start(run: str, attempt: int, offset: int) -> int | None:
    """Where this session's part of the shared file starts, the same on every
    process: the file's size when the job's *first* process opened it, or
    None when alone (or when the coordination service cannot say).

    First come, first served (``key_value_set`` refuses to overwrite; whoever
    is refused reads the winner's), so nobody waits for anybody; why:
    docs/architecture.md, "A late opener knows what the others wrote". The
    k-th session of ``(run, attempt)`` on each process is paired with the k-th
    on the others, as in ``close_barrier``.
    """
    client = _client()
    if client is None or not _multi_process():
        return None
    with _state_lock:
        k = _open_calls.get((run, attempt), 0)
        _open_calls[(run, attempt)] = k + 1
    key = f"pmaptap/{run}/opened/{attempt}/{k}"
    try:
        client.key_value_set(key, str(int(offset)))
        return int(offset)
    except Exception:  # noqa: BLE001 - refused: another process was first
        pass
    try:
        return int(client.key_value_try_get(key))
    except Exception as e:  # noqa: BLE001 - open must not fail for this
        log.warning(
            f"pmaptap: could not agree with the other processes where run "
            f"{run!r} starts in the tap file ({type(e).__name__}: {e}); "
            "replicated values they wrote before this process opened may be "
            "written again."
        )
        return None


def close_barrier(
    run: str,
    timeout: float,
    *,
    on_unclosed: "Callable[[list[int] | None], None] | None" = None,
    eager: bool = False,
    wait: bool = True,
) -> None:
    """Wait (at most ``timeout`` seconds) until every process has closed its
    session for ``run``; then the file holds every process's records.

    Each process sets ``pmaptap/<run>/closed/<k>/<pid>`` (after draining), then
    waits at a coordination-service barrier; on timeout it warns naming the
    processes whose key is missing. Never raises, no device collectives.
    ``on_unclosed`` gets the processes not seen to close (None: unknown) when
    the wait fails and, with ``eager`` (a process being terminated), before it
    waits, so the sharded layout writes what they own (sinks/directory.py:
    Held). ``wait=False`` (SIGTERM: a peer may be dead, the grace short)
    announces the close and makes the eager call without waiting.
    """
    client = _client()
    if client is None:
        if not _forked and _warn_if_shut_down_early(run) and on_unclosed is not None:
            on_unclosed(None)
        return
    try:
        n, pid = _process_info()
        if n <= 1:
            return
        with _state_lock:
            # Unique per close: two sessions that share an explicit run id
            # (e.g. Session(path, run="exp1") twice) get distinct barriers.
            k = _close_calls.get(run, 0)
            _close_calls[run] = k + 1
        prefix = f"pmaptap/{run}/closed/{k}/"
        client.key_value_set(prefix + str(pid), str(time.time()), allow_overwrite=True)
    except Exception as e:  # noqa: BLE001 - close must not raise
        log.warning(
            f"pmaptap: could not announce the close of run {run!r} "
            f"to the other processes ({type(e).__name__}: {e}); not "
            "waiting for them."
        )
        if on_unclosed is not None:
            on_unclosed(None)
        return
    _waiting[run] = (client, prefix, n)
    try:
        if eager and on_unclosed is not None:
            on_unclosed(_missing_processes(client, prefix, n))
        if not wait:
            return
        failure = _wait_at_barrier(client, f"pmaptap/{run}/close/{k}", timeout)
    finally:
        _waiting.pop(run, None)
    if failure is None:
        return
    missing = _missing_processes(client, prefix, n)
    if on_unclosed is not None:
        on_unclosed(missing)
    if missing is None:
        log.warning(
            f"pmaptap: the close barrier of run {run!r} failed "
            f"({type(failure).__name__}: {failure}) and the coordination "
            "service is unreachable; records of other processes may be "
            "missing from the file."
        )
    elif missing:
        log.warning(
            f"pmaptap: process(es) {', '.join(map(str, missing))} did not "
            f"close run {run!r} within {timeout:g}s (process {pid} waited); "
            "their records may be missing or still arriving in the tap file. "
            "Raise Session(close_timeout=...) if they are just slow."
        )
    # else: everybody has closed by now (we are the late one and the barrier
    # had already timed out for the others): the file is complete.


# The close barriers being waited at, by run: (client, key prefix, processes).
_waiting: dict[str, tuple[Any, str, int]] = {}


def unclosed_now(run: str) -> list[int] | None:
    """During ``close_barrier(run)``'s wait (a SIGTERM handler asks): the
    processes that have not closed yet; None when nobody waits or the
    coordination service cannot say."""
    got = _waiting.get(run)
    return None if got is None else _missing_processes(*got)


def _warn_if_shut_down_early(run: str) -> bool:
    """A multi-process backend but no coordination client: somebody called
    jax.distributed.shutdown() before closing the session. True if so."""
    try:
        import jax
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized() or jax.process_count() <= 1:
            return False
    except Exception:  # noqa: BLE001
        return False
    log.warning(
        f"pmaptap: jax.distributed was shut down before session "
        f"{run!r} closed, so its close could not wait for the other "
        "processes; their records may still be arriving. Close the "
        "session first."
    )
    return True


def _wait_at_barrier(client: Any, barrier_id: str, timeout: float) -> BaseException | None:
    """The barrier wait, on a helper thread: the C++ call releases the GIL
    but does not return to Python until it ends, so waiting on it from the
    main thread would keep SIGTERM / Ctrl-C handlers from running (a peer
    that died could then only be survived by SIGKILL). Returns the failure,
    or None when every process arrived."""
    box: list[BaseException | None] = [
        TimeoutError(f"barrier {barrier_id!r} did not answer within {timeout:g}s")
    ]
    done = threading.Event()

    def wait() -> None:
        try:
            client.wait_at_barrier(barrier_id, max(1, int(timeout * 1000)))
            box[0] = None
        except Exception as e:  # noqa: BLE001
            box[0] = e
        finally:
            done.set()

    threading.Thread(target=wait, daemon=True, name="pmaptap-close-barrier").start()
    # Event.wait is interrupted for signal handlers; the margin covers the
    # service's own timeout bookkeeping.
    done.wait(timeout + 5.0)
    return box[0]


def _missing_processes(client: Any, prefix: str, n: int) -> list[int] | None:
    try:
        entries = client.key_value_dir_get(prefix)
    except Exception:  # noqa: BLE001
        return None
    arrived = set()
    for key, _ in entries:
        tail = key.rstrip("/").rsplit("/", 1)[-1]
        if tail.isdigit():
            arrived.add(int(tail))
    return [p for p in range(n) if p not in arrived]


# --------------------------------------------------------------- hosts
# A fingerprint record (pmaptap.fingerprint) names the host of every holder
# of a copy that differs, and one process writes it: the others' host names
# come from here. Each process publishes its own once (when it first traces a
# fingerprint: every process of a job traces the same program); the writer
# reads them only when a record needs them, without waiting.
_HOST_KEY = "pmaptap/hosts/{}"
_host_published = False
_hosts: dict[int, str] = {}


def publish_host() -> None:
    """Tell the job this process's host name (a no-op in a job of one
    process, and after the first call)."""
    global _host_published
    if _host_published:
        return
    _host_published = True
    client = _client() if _multi_process() else None
    if client is None:
        return
    import socket

    try:
        client.key_value_set(
            _HOST_KEY.format(_process_info()[1]), socket.gethostname(), allow_overwrite=True
        )
    except Exception as e:  # noqa: BLE001 - the host is then unknown (null)
        log.debug(f"pmaptap: could not publish this process's host name: {e!r}")


def host_of(process: int) -> str | None:
    """The host name process ``process`` published, or None (not yet, not
    a multi-process job, or the coordination service is gone)."""
    got = _hosts.get(process)
    if got is not None:
        return got
    client = _client() if _multi_process() else None
    if client is None:
        return None
    try:
        got = client.key_value_try_get(_HOST_KEY.format(int(process)))
    except Exception:  # noqa: BLE001 - not published (or no service): unknown
        return None
    _hosts[process] = got
    return got


def mode() -> str | None:
    """What the last initialize() did (None if it was never called)."""
    return _mode


__all__ = [
    "DistributedError",
    "agree_run_id",
    "close_barrier",
    "detect_cluster",
    "host_of",
    "initialize",
    "launcher_settings",
    "mode",
    "publish_host",
    "session_start",
    "unclosed_now",
]
