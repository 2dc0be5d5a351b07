"""pmaptap.fingerprint across real processes (jax.distributed on loopback,
started by pmaptap.launch): the fingerprints of every process's devices meet
on one device, one process writes the records, and the odd copy is named
with its device, process, host and step.

Device ids on multi-process CPU: process p's k-th device is p*2048+k;
jax.devices() lists them process by process."""

from __future__ import annotations

import sys

import pytest

import pmaptap
from conftest import job_failed, prefixed, python_cmd, run_launch, train_argv
from pmaptap.tapfile.analyze.fingerprints import suspects
from pmaptap.tapfile.analyze.validate import validate_file

_JOB = """
    import os, socket
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import pmaptap, pmaptap.distributed as dist

    dist.initialize()
    if jax.process_index() == 1:
        # Another host's name: the record can only learn it from process 1.
        socket.gethostname = lambda: "node-b"
    with pmaptap.Session(os.environ["TAP"]):
        # pmap over the job's 4 devices: global coordinate 3 (process 1's
        # second device, id 2049) computes another value at step 1.
        def body(x, step):
            x = x * 1.5
            bad = (lax.axis_index("i") == 3) & (step == 1)
            x = jnp.where(bad, x.at[0].add(1.0), x)
            pmaptap.fingerprint({"x": x}, "pmapped", step=step)
            return x

        f = jax.pmap(body, axis_name="i", in_axes=(0, None))
        local = jnp.ones((jax.local_device_count(), 4))
        for step in range(3):
            # (A jnp int: JAX 0.9's multi-process pmap takes no Python int.)
            f(local, jnp.int32(step)).block_until_ready()

        # jit over a 2x2 mesh of all devices, the value replicated: the copy
        # at data=1, model=0 (process 1's first device, id 2048) differs at
        # step 2, changed by a shard_map that jit cannot see through.
        mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
        # bfloat16: the packed dtypes' words are compared across processes too.
        start = np.arange(64.0).astype(jnp.bfloat16).reshape(8, 8)
        w = jax.make_array_from_callback((8, 8), NamedSharding(mesh, P()), lambda i: start[i])

        def corrupt(block, hit):
            on = hit & (lax.axis_index("data") == 1) & (lax.axis_index("model") == 0)
            return jnp.where(on, block.at[1, 1].add(1.0), block)

        @jax.jit
        def g(w, step):
            w = jax.shard_map(
                corrupt, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False
            )(w * 1.0, step == 2)
            pmaptap.fingerprint(w, "jitted", step=step)
            return w

        for step in range(4):
            w = g(w, step)
        jax.block_until_ready(w)
"""


# The job as written (host callbacks), and with pmaptap.pmap / pmaptap.jit
# (the fingerprints leave the steps as outputs): the same records.
_TRANSPORTS = {
    "callback": _JOB,
    "outputs": _JOB.replace("jax.pmap(", "pmaptap.pmap(").replace("@jax.jit", "@pmaptap.jit"),
}


@pytest.fixture(scope="module", params=sorted(_TRANSPORTS))
def job(request, tmp_path_factory):
    code = _TRANSPORTS[request.param]
    assert request.param == "callback" or "pmaptap.pmap(" in code and "@pmaptap.jit" in code
    tap = str(tmp_path_factory.mktemp("fp") / "fp.jsonl")
    proc, _ = run_launch(2, 2, python_cmd(code), launcher_timeout=120, timeout=180, TAP=tap)
    assert proc.returncode == 0, job_failed(proc)
    return tap, pmaptap.read(tap)


def _steps(recs: list[dict], name: str) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in recs:
        if r["name"] == name and r["kind"] == "fingerprint":
            out.setdefault(r["step"], []).append(r)
    return out


@pytest.mark.parametrize(
    "name, bad_step, device, coords, steps",
    [
        ("pmapped", 1, 2049, {"i": 3}, 3),
        ("jitted", 2, 2048, {"data": 1, "model": 0}, 4),
    ],
)
def test_two_processes_name_the_device_process_host_and_step(
    job, name, bad_step, device, coords, steps
):
    tap, recs = job
    by_step = _steps(recs, name)
    assert sorted(by_step) == list(range(steps))
    for step, rs in by_step.items():
        # One process wrote every record (the fingerprints met on a device):
        # nothing twice, whatever the number of processes.
        assert {r["process"] for r in rs} == {0}
        if step < bad_step:
            (r,) = rs
            assert r["devices"] == [0, 1, 2048, 2049] and r["processes"] == [0, 1]
            assert not r.get("divergent")
    if name == "pmapped":
        assert not any(r.get("divergent") for r in by_step[2])  # only step 1 differed
    majority, odd = by_step[bad_step]
    assert majority["devices"] == sorted({0, 1, 2048, 2049} - {device})
    assert majority["processes"] == [0, 1]
    assert odd["devices"] == [device] and odd["processes"] == [1]
    assert odd["holders"] == [{"device": device, "process": 1, "host": "node-b", "coords": coords}]
    (s,) = suspects(recs)[(odd["run"], name)]
    assert (s.device, s.process, s.host, s.first_step) == (device, 1, "node-b", bad_step)


def test_the_job_file_is_valid_and_its_summary_names_the_suspects(job):
    tap, recs = job
    report = validate_file(tap)
    assert report.ok, report.problems
    assert report.divergent_fingerprints == 1 + 2  # pmapped step 1, jitted steps 2-3
    from pmaptap.tapfile.analyze.table import summary_table

    table = summary_table(recs)
    assert "suspect device 2049 (process 1, host node-b, i=3)" in table
    assert "suspect device 2048 (process 1, host node-b, data=1,model=0)" in table


def test_demo_fault_is_named_by_its_summary(tmp_path):
    """README's demo: --fault flips one bit in one device's copy of the
    parameters (process 1's second device) before a step; the summary the
    job prints at its end names that device, its process and the step."""
    out = str(tmp_path / "demo.jsonl")
    argv = train_argv(out, "--fault", "device=2049,step=2", steps=4)
    proc, _ = run_launch(2, 2, argv, launcher_timeout=120, timeout=180)
    assert proc.returncode == 0, job_failed(proc)
    assert "fault: bit 12 of b1[0] flipped on device 2049" in proc.stdout
    (line,) = [ln for ln in prefixed(proc.stdout, 0) if ln.startswith("params ")]
    assert "first at step 2, leaf b1: suspect device 2049 (process 1" in line, line
    recs = [r for r in pmaptap.read(out) if r["name"] == "params"]
    assert sorted({r["step"] for r in recs}) == [0, 1, 2, 3]
    assert not any(r.get("divergent") for r in recs if r["step"] < 2)


def test_a_fault_on_a_device_the_job_lacks_is_refused():
    """A bare ``python launch/train.py`` has one device: a fault on device 3
    would never fire and the job would end with exit 0 and no suspect. It is
    refused before training, saying how to get the devices."""
    import subprocess

    from conftest import ROOT, subprocess_env

    for fault, says in (
        ("device=3,step=7", "--fault device=3: this job has no such device (its 1 device(s): 0)"),
        ("device=0,step=30", "--fault step=30: the job runs steps 0-19"),
    ):
        proc = subprocess.run(
            [sys.executable, "launch/train.py", "--out", "unused.jsonl", "--fault", fault],
            env=subprocess_env(1),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
        assert says in proc.stderr, proc.stderr
        assert "pmaptap train:" not in proc.stdout  # refused before training
        if fault.startswith("device=3"):
            assert "python -m pmaptap.launch --processes 2 --devices 4" in proc.stderr


def test_readme_fault_demo_names_the_device(tmp_path):
    """The README's fault demo, as it writes it: the demo command (under the
    launcher) with the ``--fault`` it names added; its summary names the
    device whose copy was flipped."""
    import re
    import shlex
    import subprocess

    from conftest import ROOT, subprocess_env

    with open(f"{ROOT}/README.md", encoding="utf-8") as f:
        text = f.read()
    demo = text.split("## Two commands", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    command = demo.split(" && ", 1)[1]  # after the install
    added = re.search(r"the demo command above with `(--fault [^`]+)`\s+added", text)
    assert added, "the README names no --fault to add to the demo command"
    out = str(tmp_path / "demo.jsonl")
    argv = shlex.split(command.replace("out/demo.jsonl", out)) + shlex.split(added[1])
    assert argv[:3] == ["python", "-m", "pmaptap.launch"], argv
    argv[0] = sys.executable
    proc = subprocess.run(
        argv, env=subprocess_env(1), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, job_failed(proc)
    device = re.search(r"device=(\d+)", added[1])[1]
    (line,) = [ln for ln in prefixed(proc.stdout, 0) if ln.startswith("params ")]
    assert f"suspect device {device} (process 0" in line, line
