"""Reading sharded runs (issue 29): ``pmaptap.read``, ``summary`` and
``validate`` of a run of many shards against a bare orjson loop over the
same shard files, each command in a fresh process (interpreter start-up
included on both sides), as bench_read.py does for one file.

Arms:
- m. 256 shards: read / summary / validate (default --jobs, and --jobs 1),
  CPU-time ratio to the bare loop (issue 39's targets: read <= 2.0x,
  summary <= 1.5x, validate <= 2.0x); the same records as one file, for
  comparison; and every line decoded by pmaptap's decoder with nothing
  else done, the floor of any reader built on it;
- n. 4,096 shards under ``ulimit -n 256``: read / summary / validate / show
  work, peak RSS (target <= 300 MiB);
- p. ``summary --jobs 2`` of a 4,096-shard run against ``--jobs 1``: wall
  ratio of paired rounds (target <= 0.65x on an otherwise quiet 2-core
  box) and the same output, byte for byte;
- o. an object-store run of 32 processes (a loopback moto server, as
  tests/host/test_object_store.py uses) against the same run on local disk
  (target <= 3x), at 200 steps a process (6,400 lines: the client's start,
  ``import s3fs`` and one client, is most of it, and alone several times
  the whole read from disk) and at 4,000 (128,000 lines: the reading
  itself), beside a stdlib client (no s3fs, no pmaptap, nothing parsed:
  Python, one signed listing, each object's GET), the least any client
  could take against this server; only where moto and s3fs are installed.

- s. a job's run at scale (``--lines``: sizes, ``--jobs``: the jobs to
  time ``summary`` with, ``--validate-jobs`` ``validate``'s): 256
  processes in the sharded layout, each writing one per-device value for
  each of its 8 devices every step and process 0 the loss, as the JAX-free
  ``Writer`` writes them (``generate_job``, several processes at once);
  per line, the cost of each command in a fresh process (``--rounds``
  interleaved rounds, one by default), its speed-up on ``--jobs 1`` of the
  same size (the paired median), and the parallel orjson floor (as many
  processes as the most jobs, each an orjson loop over its share of the
  shard files); the outputs of every ``--jobs`` compared, byte for byte.

  The issue's sizes on a 13-core machine (~6 minutes, ~10 GiB under
  /tmp; ``--jobs 1`` at 4.9 M lines only, per line the same at 49.2 M):
  ``python benchmarks/bench_read_scale.py --part s --lines 4.9M --jobs
  1,2,4,8,12 --validate-jobs 1,12 --tmp /tmp && python
  benchmarks/bench_read_scale.py --part s --lines 49.2M --jobs 2,4,8,12
  --validate-jobs 12 --tmp /tmp``.

- f. the fixed cost of ``--jobs N``: ``summary`` of a tiny run (a job's,
  as in s.: 256 processes x 8 devices, one step, 2,049 lines, so the
  reading is a few milliseconds and what is left is starting workers,
  handing them pieces and taking their states in) with ``--jobs N``
  against ``--jobs 1``, fresh processes in interleaved rounds (each
  round's order reversed from the last): per N, the paired median of the
  wall-time difference in milliseconds, and the outputs compared.

``--part m`` (or n, p, o, s, f; repeatable) runs only those arms. Every run
also prints the lines of pmaptap/tapfile/'s Python files (target <= 7,500).

The runs are generated without JAX (``generate``): per step and process a
per-device value and a replicated value every process writes (deduped by
the reader), times interleaved across shards. ``reference`` writes the same
run as one file in the order the merge must give (sort by time, then
process, then line; first copy of a replicated value kept): the definition
tests/tapfile/test_read_scale.py compares the merge with.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.common import (  # noqa: E402
    BARE_ORJSON_LOOP,
    compile_bytecode,
    interleaved_rounds,
    loopback_s3,
    measure_process,
    measure_process_times,
    spread,
    table,
)

T0 = 1.8e9

_BARE = (
    "import sys, os, orjson\n"
    "n = 0\n"
    "d = sys.argv[1]\n"
    "for name in sorted(os.listdir(d)):\n"
    "    with open(os.path.join(d, name), 'rb') as f:\n"
    "        for line in f:\n"
    "            try:\n"
    "                orjson.loads(line)\n"
    "            except orjson.JSONDecodeError:\n"
    "                pass\n"
    "            n += 1\n"
    "print(n)\n"
)
_BARE_FILE = BARE_ORJSON_LOOP


def records(shards: int, steps: int, devices: int = 1) -> list[list[dict]]:
    """The records of each shard, in its write order."""
    out = []
    for p in range(shards):
        mine = []
        for s in range(steps):
            # Processes write each step at slightly different times (and
            # some at the same time: ties go by process).
            t = T0 + s * 0.1 + (p % 13) * 1e-4
            value = 1.0 / (s + 1)
            if p == 5 and s == 1:
                value = 7.0  # one process disagrees: divergent
            mine.append(
                {
                    "run": "bench",
                    "name": "loss",
                    "step": s,
                    "kind": "replicated",
                    "value": value,
                    "dtype": "float32",
                    "shape": [],
                    "process": p,
                    "time": t,
                    "host": f"node-{p}",
                    "replicas": devices,
                    "devices": list(range(p * devices, (p + 1) * devices)),
                    "processes": [p],
                    "vhash": f"{hash(value) & 0xFFFFFFFF:016x}",
                }
            )
            for d in range(p * devices, (p + 1) * devices):
                mine.append(
                    {
                        "run": "bench",
                        "name": "grad_norm",
                        "step": s,
                        "kind": "per_device",
                        "value": 0.5 + d + s * 1e-4,
                        "dtype": "float32",
                        "shape": [],
                        "process": p,
                        "time": t,
                        "host": f"node-{p}",
                        "device": d,
                        "coords": {"dp": d},
                    }
                )
        out.append(mine)
    return out


def generate(path: str, shards: int, steps: int, devices: int = 1, bad: bool = False) -> int:
    """A sharded run ``path.d/p*.jsonl``; returns its size in bytes. ``bad``:
    a garbage line in shard 17's middle and a torn last line in the last
    shard (a writer killed mid-line)."""
    import orjson

    d = path + ".d"
    os.makedirs(d, exist_ok=True)
    size = 0
    for p, mine in enumerate(records(shards, steps, devices)):
        lines = [orjson.dumps(r) + b"\n" for r in mine]
        if bad and p == 17 % shards:
            lines.insert(len(lines) // 2, b"garbage, not JSON\n")
        if bad and p == shards - 1:
            lines.append(b'{"run": "bench", "name": "lo')
        data = b"".join(lines)
        with open(os.path.join(d, f"p{p:05d}.jsonl"), "wb") as f:
            f.write(data)
        size += len(data)
    return size


def reference(path: str, shards: int, steps: int, devices: int = 1) -> None:
    """The run of ``generate`` (without bad lines) as one file, in the order
    the merge gives: by time, then process, then line; a replicated value
    another process already wrote is left out (the one-file writer skips
    it)."""
    import orjson

    rows = [
        (r["time"], p, i, r)
        for p, mine in enumerate(records(shards, steps, devices))
        for i, r in enumerate(mine)
    ]
    rows.sort(key=lambda x: x[:3])
    seen = set()
    with open(path, "wb") as f:
        for *_, r in rows:
            if r["kind"] == "replicated":
                k = (r["name"], r["step"], r["vhash"])
                if k in seen:
                    continue
                seen.add(k)
            f.write(orjson.dumps(r) + b"\n")


def _job_shard(task: tuple) -> int:
    """One process's shard of ``generate_job``: its lines as the ``Writer``
    writes them (a time of its own a line), formatted directly."""
    path, p, steps, devices = task
    host = f"node-{p}"
    name = os.path.join(path + ".d", f"p{p:05d}.jsonl")
    buf: list[str] = []
    size = 0
    with open(name, "wb") as f:
        for s in range(steps):
            t = T0 + s * 0.5 + p * 1e-4
            for k in range(devices):
                d = p * devices + k
                buf.append(
                    f'{{"run":"job","name":"grad_norm","step":{s},"kind":"per_device",'
                    f'"value":{0.5 + d + s * 1e-4!r},"dtype":"float32","shape":[],'
                    f'"process":{p},"time":{t + k * 1e-6!r},"host":"{host}",'
                    f'"device":{d},"coords":{{}}}}\n'
                )
            if p == 0:
                v = 1.0 / (s + 1)
                buf.append(
                    f'{{"run":"job","name":"loss","step":{s},"kind":"replicated",'
                    f'"value":{v!r},"dtype":"float32","shape":[],"process":0,'
                    f'"time":{t + devices * 1e-6!r},"host":"{host}","replicas":1,'
                    f'"processes":[0],"vhash":"{hash(v) & (2**64 - 1):016x}"}}\n'
                )
            if len(buf) >= 8192:
                data = "".join(buf).encode()
                f.write(data)
                size += len(data)
                buf = []
        data = "".join(buf).encode()
        f.write(data)
    return size + len(data)


def generate_job(path: str, processes: int, steps: int, devices: int = 8) -> int:
    """A job's sharded run ``path.d/p*.jsonl`` (see the arm s. above),
    written by as many processes as there are cores; its bytes."""
    from multiprocessing import get_context

    os.makedirs(path + ".d", exist_ok=True)
    tasks = [(path, p, steps, devices) for p in range(processes)]
    with get_context("fork").Pool(os.cpu_count() or 1) as pool:
        return sum(pool.map(_job_shard, tasks, chunksize=1))


# The floor of reading a run from a store with the client pmaptap uses: the
# client's import, one listing and every non-empty object fetched
# concurrently (fsspec's own concurrency), nothing parsed.
_BARE_STORE = (
    "import sys, s3fs\n"
    "fs = s3fs.S3FileSystem()\n"
    "found = fs.find(sys.argv[1].rstrip('/') + '.d', detail=True)\n"
    "names = [n for n, e in found.items() if e['size']]\n"
    "print(sum(map(len, fs.cat(names).values())))\n"
)
# What every read from a store pays before its first request: Python, the
# client's import and one client.
_CLIENT_START = "import s3fs\ns3fs.S3FileSystem()\n"
# The least any client could take here: the standard library alone (no
# s3fs, nothing of pmaptap), one listing and each object fetched in turn
# on one connection, each request signed (AWS SigV4, as moto checks it),
# nothing parsed. Python's start, the listing and moto's GETs: what a
# second, faster-starting client could at best get down to.
_BARE_STDLIB = r"""
import datetime, hashlib, hmac, http.client, os, re, sys, urllib.parse
url = urllib.parse.urlparse(os.environ["AWS_ENDPOINT_URL"])
bucket, prefix = sys.argv[1][5:].split("/", 1)
conn = http.client.HTTPConnection(url.hostname, url.port)
def get(path, query=""):
    now = datetime.datetime.now(datetime.timezone.utc)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    empty = hashlib.sha256(b"").hexdigest()
    signed = "host;x-amz-content-sha256;x-amz-date"
    canon = "\n".join(["GET", path, query, "host:" + url.netloc,
                       "x-amz-content-sha256:" + empty, "x-amz-date:" + stamp, "",
                       signed, empty])
    scope = day + "/" + os.environ["AWS_DEFAULT_REGION"] + "/s3/aws4_request"
    key = ("AWS4" + os.environ["AWS_SECRET_ACCESS_KEY"]).encode()
    for part in scope.split("/"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    text = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                      hashlib.sha256(canon.encode()).hexdigest()])
    sig = hmac.new(key, text.encode(), hashlib.sha256).hexdigest()
    auth = ("AWS4-HMAC-SHA256 Credential=" + os.environ["AWS_ACCESS_KEY_ID"] + "/" + scope
            + ", SignedHeaders=" + signed + ", Signature=" + sig)
    conn.request("GET", path + ("?" + query if query else ""), headers={
        "x-amz-date": stamp, "x-amz-content-sha256": empty, "Authorization": auth})
    response = conn.getresponse()
    body = response.read()
    assert response.status == 200, (response.status, body[:200])
    return body
query = "list-type=2&prefix=" + urllib.parse.quote(prefix + ".d/", safe="")
listing = get("/" + bucket, query)
assert b"IsTruncated>false" in listing  # one page: every object listed
names = re.findall(rb"<Key>([^<]+)</Key>", listing)
print(sum(len(get("/" + bucket + "/" + n.decode())) for n in names))
"""
_LIMITED = (
    "import resource, runpy, sys\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
    "sys.argv = ['pmaptap'] + sys.argv[1:]\n"
    "runpy.run_module('pmaptap', run_name='__main__')\n"
)
_READ = "import sys, pmaptap\nprint(len(pmaptap.read(sys.argv[1])))\n"
_READ_LIMITED = (
    "import resource, sys\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
    "import pmaptap\n"
    "print(len(pmaptap.read(sys.argv[1])))\n"
)


# The least any reader built on pmaptap's decoder can cost: every source's
# lines decoded and checked (lines.iter_file_records, the gate and msgspec's
# Structs), nothing summarized, merged or kept. What a command costs above
# this is its own Python (docs/performance.md, "Reading sharded runs").
_DECODE_ONLY = (
    "import sys\n"
    "from pmaptap.tapfile.source import run as runs\n"
    "from pmaptap.tapfile.source.lines import iter_file_records\n"
    "n = 0\n"
    "for source in runs.sources(sys.argv[1]):\n"
    "    for _, records, _ in iter_file_records(source):\n"
    "        n += len(records)\n"
    "print(n)\n"
)


# The parallel floor: N processes, each an orjson loop over its share of
# the shard files (every N-th), nothing checked.
# _BARE's loop over a process's share (``names``), its count handed back.
_SHARE_LOOP = _BARE.replace("sorted(os.listdir(d))", "names").replace("print(n)", "got.append(n)")
_BARE_PARALLEL = (
    "import os, sys, orjson\n"
    "from multiprocessing import get_context\n"
    "def count(names):\n"
    "    exec(LOOP, {'orjson': orjson, 'os': os, 'sys': sys, 'got': got, 'names': names})\n"
    "    return got.pop()\n"
    "got = []\n"
    f"LOOP = {_SHARE_LOOP!r}\n"
    "d, j = sys.argv[1], int(sys.argv[2])\n"
    "names = [os.path.abspath(os.path.join(d, x)) for x in sorted(os.listdir(d))]\n"
    "with get_context('fork').Pool(j) as pool:\n"
    "    print(sum(pool.map(count, [names[k::j] for k in range(j)], chunksize=1)))\n"
)


def _make(fn: str, *args) -> int:
    """``fn(*args)`` of this module in a child process: a reader measured
    later is forked from this process, and its peak RSS counts this
    process's pages at the fork (the runs are built in memory)."""
    code = f"from benchmarks.bench_read_scale import {fn}; import sys; print({fn}(*{args!r}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
    got = out.stdout.decode().strip()
    return int(got) if got.isdigit() else 0


def measure(cmd: list[str], env: dict | None = None) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one command in its own process."""
    # validate exits 1 on a run with bad lines
    return measure_process(cmd, cwd=ROOT, env=env, ok=(0, 1))


def _rounds(arms: dict, rounds: int, env=None) -> tuple[dict, dict]:
    walls: dict = {k: [] for k in arms}
    rss: dict = {}
    for _ in range(rounds):
        for name, cmd in arms.items():
            w, peak = measure(cmd, env)
            walls[name].append(w)
            rss[name] = max(peak, rss.get(name, 0.0))
    return walls, rss


def _paired(arms: dict, bases: dict, rounds: int) -> tuple[dict, dict, dict]:
    """Per round and arm, the arm's bare loop (``bases[arm]``) run right
    before it: the ratio of each pair, so that both meet the same load.
    -> (wall-time ratios by arm, CPU-time ratios by arm, peak RSS by arm)."""
    ratios: dict = {k: [] for k in arms}
    cpu: dict = {k: [] for k in arms}
    rss: dict = {}
    for _ in range(rounds):
        for name, cmd in arms.items():
            b, bc, _ = measure_process_times(bases[name], cwd=ROOT, ok=(0, 1))
            w, wc, peak = measure_process_times(cmd, cwd=ROOT, ok=(0, 1))
            ratios[name].append(w / b)
            cpu[name].append(wc / bc)
            rss[name] = max(peak, rss.get(name, 0.0))
    return ratios, cpu, rss


def _report(title: str, walls: dict, rss: dict, base: str) -> None:
    b = statistics.median(walls[base])
    rows = []
    for name, ts in walls.items():
        t = statistics.median(ts)
        rows.append(
            (
                name,
                spread(ts, " s"),
                f"{t / b:.2f}x",
                f"{rss[name]:.0f} MiB",
            )
        )
    print(title)
    print(table(rows, ("command", "time", "vs base", "peak RSS")))


def _object_store(tmp: str, procs: int, steps: int, rounds: int) -> None:
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError:
        print("o. object store: skipped (moto[server] and s3fs not installed)")
        return
    with loopback_s3(os.path.join(tmp, f"moto-{steps}.log")) as s3_env:
        env = dict(os.environ, **s3_env)
        local = os.path.join(tmp, f"os-local-{steps}.jsonl")
        url = f"s3://taps/run{steps}"
        # Each process writes its run through real Writers: five chunks a
        # process on the store, rolled up into one object at close
        # (tapfile/source/store.py), and one shard on disk.
        write = (
            "import sys, s3fs, pmaptap\n"
            "local, url = sys.argv[1:3]\n"
            "procs, steps = int(sys.argv[3]), int(sys.argv[4])\n"
            "s3fs.S3FileSystem().mkdir('taps')\n"
            "for p in range(procs):\n"
            "    for where in (local, url):\n"
            "        with pmaptap.Writer(where, run='r', process=p, layout='sharded') as w:\n"
            "            for s in range(steps):\n"
            "                w.write('gn', s, float(p + s), kind='per_device', device=p)\n"
            "                if s % (steps // 4 or 1) == 0:\n"
            "                    w.flush()\n"
        )
        subprocess.run(
            [sys.executable, "-c", write, local, url, str(procs), str(steps)],
            cwd=ROOT,
            env=env,
            check=True,
        )
        read, floor, disk, start, least = (
            "o. object store, pmaptap.read",
            "o. object store, bare client (floor)",
            "o. local disk, pmaptap.read",
            "o. the client's start alone",
            "o. a stdlib client, nothing parsed",
        )
        arms = {
            read: [sys.executable, "-c", _READ, url],
            floor: [sys.executable, "-c", _BARE_STORE, url],
            disk: [sys.executable, "-c", _READ, local],
            start: [sys.executable, "-c", _CLIENT_START],
            least: [sys.executable, "-c", _BARE_STDLIB, url],
        }
        walls, rss = _rounds(arms, rounds, env)
        _report(
            f"o. {procs} processes x {steps} steps ({procs * steps} lines), object store vs disk:",
            walls,
            rss,
            disk,
        )
        m = {k: statistics.median(v) for k, v in walls.items()}
        print(
            f"o. object store read ratio, {steps} steps: {m[read] / m[disk]:.2f}x the same "
            f"run on disk (target <= 3x); {m[read] / m[floor]:.2f}x the bare client's import "
            f"and concurrent fetch of the same objects; the client's start alone is "
            f"{m[start] / m[disk]:.2f}x the whole read from disk; a stdlib client's "
            f"listing and fetch, nothing parsed, {m[least] / m[disk]:.2f}x"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--quick", action="store_true", help="small runs, one round: checks that it runs"
    )
    ap.add_argument("--rounds", type=int)
    ap.add_argument(
        "--part",
        choices=("m", "n", "p", "o", "s", "f"),
        action="append",
        help="only these arms (m: 256 shards, n: 4,096 shards, p: summary --jobs 2 of "
        "4,096 shards, o: object store, s: a job's run at scale, f: the fixed cost of "
        "--jobs N on a tiny run); all by default",
    )
    ap.add_argument(
        "--lines",
        default="6.2M",
        help="s.: the runs' sizes in lines, comma-separated (4.9M, 49.2M, 620000)",
    )
    ap.add_argument(
        "--jobs",
        default="1,2,12",
        help="s., f.: the --jobs to time summary with (1,2,4,8,12)",
    )
    ap.add_argument("--validate-jobs", default="1,12", help="s.: the --jobs to time validate with")
    ap.add_argument("--devices", type=int, default=8, help="s.: each process's devices")
    ap.add_argument("--tmp", help="s.: where the runs are written (default: a temporary directory)")
    a = ap.parse_args(argv)
    parts = set(a.part or "mnposf")
    rounds = a.rounds or (1 if a.quick else 5)
    compile_bytecode()  # readers start as an installed package's do
    tapfile = os.path.join(ROOT, "pmaptap", "tapfile")
    lines = 0
    for name in sorted(os.listdir(tapfile)):
        if name.endswith(".py"):
            with open(os.path.join(tapfile, name), "rb") as f:
                lines += f.read().count(b"\n")
    print(f"pmaptap/tapfile/: {lines} lines of Python (target <= 7,500)")
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        if "s" in parts:
            sizes = [20_000] if a.quick else [_count(x) for x in a.lines.split(",")]
            jobs = [1, 2] if a.quick else [int(x) for x in a.jobs.split(",")]
            vjobs = [1, 2] if a.quick else [int(x) for x in a.validate_jobs.split(",") if x]
            for lines in sizes:
                _at_scale(tmp, lines, jobs, vjobs, a.devices, a.rounds or 1)
        if "f" in parts:
            jobs = [1, 2] if a.quick else [int(x) for x in a.jobs.split(",")]
            _fixed_cost(tmp, jobs, 3 if a.quick else (a.rounds or 15))
        if "m" in parts:
            _many_shards(tmp, a.quick, rounds)
        if "n" in parts:
            _thousands_of_shards(tmp, a.quick)
        if "p" in parts:
            _jobs(tmp, a.quick, rounds)
        if "o" in parts:
            # The run (200 steps a process: the client's start is
            # most of its read) and one 20x longer, where the reading is.
            for steps in (8,) if a.quick else (200, 4000):
                _object_store(tmp, 32, steps, rounds)
    return 0


def _many_shards(tmp: str, quick: bool, rounds: int) -> None:
    py = sys.executable
    # m. 256 shards, 102,400 lines (quick: 2,560).
    shards, steps = 256, (5 if quick else 200)
    path = os.path.join(tmp, "m.jsonl")
    size = _make("generate", path, shards, steps)
    one = os.path.join(tmp, "m-one.jsonl")
    _make("reference", one, shards, steps)
    arms = {
        "m. bare orjson loop (shards)": [py, "-c", _BARE, path + ".d"],
        "m. sharded: decode only (the decoder's floor)": [py, "-c", _DECODE_ONLY, path],
        "m. sharded: pmaptap.read": [py, "-c", _READ, path],
        "m. sharded: pmaptap summary": [py, "-m", "pmaptap", "summary", path],
        "m. sharded: pmaptap summary --jobs 1": [py, "-m", "pmaptap", "summary", path, "-j1"],
        "m. sharded: pmaptap validate": [py, "-m", "pmaptap", "validate", path],
        "m. sharded: pmaptap validate --jobs 1": [py, "-m", "pmaptap", "validate", path, "-j1"],
        "m. bare orjson loop (one file)": [py, "-c", _BARE_FILE, one],
        "m. one file: decode only (the decoder's floor)": [py, "-c", _DECODE_ONLY, one],
        "m. one file: pmaptap.read": [py, "-c", _READ, one],
        "m. one file: pmaptap summary": [py, "-m", "pmaptap", "summary", one],
        "m. one file: pmaptap validate": [py, "-m", "pmaptap", "validate", one],
    }
    walls, rss = _rounds(arms, rounds)
    _report(
        f"m. {shards} shards, {shards * steps * 2} lines, {size / 1e6:.1f} MB; median (range) "
        f"of {rounds} round(s), fresh processes",
        walls,
        rss,
        "m. bare orjson loop (shards)",
    )
    # The ratios, each command paired with its bare loop run just
    # before it in every round (the bare loop's own time swings by a
    # third between rounds on a shared box).
    bare, bare1 = arms["m. bare orjson loop (shards)"], arms["m. bare orjson loop (one file)"]
    measured = [k for k in arms if "bare" not in k]
    ratios, cpu, _ = _paired(
        {k: arms[k] for k in measured},
        {k: bare if "sharded" in k else bare1 for k in measured},
        rounds,
    )
    for what, got in (("wall time", ratios), ("CPU time, user + system", cpu)):
        print(
            f"m. ratios to the bare loop over the same files ({what}), paired "
            "rounds, median (range) (targets, CPU: read <= 2.0x, summary <= 1.5x, "
            "validate <= 2.0x): " + ", ".join(f"{k[3:]} {spread(r, 'x')}" for k, r in got.items())
        )


def _thousands_of_shards(tmp: str, quick: bool) -> None:
    py = sys.executable
    # n. 4,096 shards under ulimit -n 256.
    shards, steps = 4096, (2 if quick else 25)
    path = os.path.join(tmp, "n.jsonl")
    size = _make("generate", path, shards, steps, 1, True)
    arms = {
        "n. bare orjson loop": [py, "-c", _BARE, path + ".d"],
        "n. pmaptap.read, ulimit -n 256": [py, "-c", _READ_LIMITED, path],
        "n. summary, ulimit -n 256": [py, "-c", _LIMITED, "summary", path],
        "n. validate, ulimit -n 256": [py, "-c", _LIMITED, "validate", path],
        "n. show --name loss, ulimit -n 256": [
            py,
            "-c",
            _LIMITED,
            "show",
            path,
            "--name",
            "loss",
        ],
    }
    walls, rss = _rounds(arms, 1)
    _report(
        f"n. {shards} shards, {shards * steps * 2} lines, {size / 1e6:.1f} MB, under ulimit -n 256",
        walls,
        rss,
        "n. bare orjson loop",
    )
    peak = max(v for k, v in rss.items() if "256" in k)
    print(f"n. 4096 shards: every reader ran; peak RSS {peak:.0f} MiB (target <= 300 MiB)")


def _jobs(tmp: str, quick: bool, rounds: int) -> None:
    """p. summary of a 4,096-shard run in 2 worker processes against 1."""
    py = sys.executable
    shards, steps = 4096, (2 if quick else 25)
    path = os.path.join(tmp, "p.jsonl")
    size = _make("generate", path, shards, steps)
    one = [py, "-m", "pmaptap", "summary", path, "--jobs", "1"]
    two = [py, "-m", "pmaptap", "summary", path, "--jobs", "2"]
    outs = [subprocess.run(c, cwd=ROOT, capture_output=True, check=True).stdout for c in (one, two)]
    same = "identical" if outs[0] == outs[1] else "DIFFERENT"
    ratios, cpu = [], []
    for _ in range(rounds):
        w1, c1, _ = measure_process_times(one, cwd=ROOT)
        w2, c2, _ = measure_process_times(two, cwd=ROOT)
        ratios.append(w2 / w1)
        cpu.append(c2 / c1)
    print(
        f"p. {shards} shards, {shards * steps * 2} lines, {size / 1e6:.1f} MB: summary --jobs 2 "
        f"wall {spread(ratios, 'x')} --jobs 1 ("
        f"{rounds} paired round(s); target <= 0.65x on a quiet 2-core box), CPU "
        f"{statistics.median(cpu):.2f}x; output {same}"
    )


def _fixed_cost(tmp: str, jobs: list[int], rounds: int) -> None:
    """f. ``summary --jobs N`` against ``--jobs 1`` of a tiny run."""
    py = sys.executable
    path = os.path.join(tmp, "f.jsonl")
    processes, devices = 256, 8
    size = _make("generate_job", path, processes, 1, devices)
    outs: set = set()  # every run's output (the warm-up's too)

    def arm(j: int) -> Callable[[], None]:
        cmd = [py, "-m", "pmaptap", "summary", path, "--jobs", str(j)]
        return lambda: outs.add(
            subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True).stdout
        )

    arms = {str(j): arm(j) for j in sorted({1, *jobs})}
    walls = interleaved_rounds(arms, rounds=rounds, steps=1)
    rows = []
    for j, ts in walls.items():
        added = [(t - one) * 1e3 for t, one in zip(ts, walls["1"])]
        rows.append(
            (
                f"f. summary --jobs {j}",
                spread(ts, " ms", scale=1e3, digits=0),
                "" if j == "1" else f"{statistics.median(added):+.1f} ms",
            )
        )
    print(
        f"f. fixed cost of --jobs N: {processes * devices + 1} lines, {size / 1e6:.2f} MB, "
        f"{processes} shards; {rounds} interleaved rounds, fresh processes, "
        f"{os.cpu_count()} cores; output {'identical' if len(outs) == 1 else 'DIFFERENT'}"
    )
    print(table(rows, ("f. command", "wall, median (range)", "added to --jobs 1, paired median")))


def _count(text: str) -> int:
    """4.9M -> 4,900,000."""
    text = text.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def _timed(cmd: list[str]) -> tuple[float, float, bytes]:
    """(wall seconds, CPU seconds of it and its workers, stdout) of a
    command in a fresh process."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode not in (0, 1):
        raise RuntimeError(f"{cmd} failed: {out.stderr.decode()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, out.stdout


def _at_scale(
    tmp: str, lines: int, jobs: list[int], vjobs: list[int], devices: int, rounds: int
) -> None:
    """s. a 256-process job's run of about ``lines`` lines; each command's
    ``--jobs`` in interleaved ``rounds`` (each round's order reversed from
    the last), speed-ups as paired medians."""
    py = sys.executable
    processes = 256
    steps = max(1, round(lines / (processes * devices)))
    path = os.path.join(tmp, f"s{steps}.jsonl")
    t0 = time.perf_counter()
    size = generate_job(path, processes, steps, devices)
    made = time.perf_counter() - t0
    n = processes * devices * steps + steps
    most = max(jobs + vjobs)
    floors = [_timed([py, "-c", _BARE_PARALLEL, path + ".d", str(most)])[0] for _ in range(rounds)]
    floor = statistics.median(floors)
    print(
        f"s. {n / 1e6:.2f} M lines ({processes} processes x {devices} devices x {steps} "
        f"steps + the loss), {size / 2**20:.0f} MiB, generated in {made:.1f} s; "
        f"{os.cpu_count()} cores; {rounds} interleaved round(s), medians (range)"
    )
    rows = [
        (f"orjson floor, {most} processes", spread(floors, " s"), f"{floor / n * 1e6:.3f}", "", "")
    ]
    for cmd, js in (("summary", jobs), ("validate", vjobs)):
        outs: dict[int, set] = {j: set() for j in js}
        walls: dict[int, list[float]] = {j: [] for j in js}
        cpus: dict[int, list[float]] = {j: [] for j in js}
        for r in range(rounds):
            for j in js if r % 2 == 0 else js[::-1]:
                wall, cpu, out = _timed([py, "-m", "pmaptap", cmd, path, "--jobs", str(j)])
                outs[j].add(out)
                walls[j].append(wall)
                cpus[j].append(cpu)
        for j in js:
            wall = statistics.median(walls[j])
            speedup = (
                statistics.median(b / w for b, w in zip(walls[1], walls[j])) if 1 in walls else None
            )
            rows.append(
                (
                    f"{cmd} --jobs {j}",
                    f"{spread(walls[j], ' s')} (CPU {statistics.median(cpus[j]):.1f} s)",
                    f"{wall / n * 1e6:.3f}",
                    f"{speedup:.2f}x" if speedup else "",
                    f"{wall / floor:.2f}x",
                )
            )
        same = len(set().union(*outs.values())) == 1
        print(f"s. {cmd}: the output of every --jobs {'identical' if same else 'DIFFERENT'}")
    print(table(rows, ("s. command", "wall", "us a line", "vs --jobs 1", "vs floor")))
    subprocess.run(["rm", "-rf", path + ".d"], check=True)


if __name__ == "__main__":
    sys.exit(main())
