"""The package layout's rules, checked on the source and in fresh interpreters:
tap files are readable where JAX is not installed, and the trace side, the
host side and the tap-file readers depend on each other only as designed."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, package_sources, run_python

PKG = os.path.join(ROOT, "pmaptap")


def _imports(package: str) -> dict[str, set[str]]:
    """module path -> the pmaptap modules it imports (absolute names)."""
    out = {}
    for rel, tree in package_sources(package):
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                mod = node.module
                if node.level:  # relative: resolve against the package
                    base = os.path.dirname(rel).split(os.sep)
                    base = base[: len(base) - node.level + 1]
                    mod = ".".join(base + [mod])
                names.add(mod)
                names.update(f"{mod}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        out[rel] = names
    return out


def test_tapfile_imports_neither_jax_nor_the_trace_or_host_side():
    found = {
        path: sorted(
            n
            for n in names
            if n.split(".")[0] == "jax" or n.startswith(("pmaptap._trace", "pmaptap._host"))
        )
        for path, names in _imports("tapfile").items()
    }
    assert len(found) >= 8, found
    assert {p: n for p, n in found.items() if n} == {}


def test_trace_side_reaches_the_host_side_only_through_routing():
    found = {
        path: sorted(
            n
            for n in names
            if n.startswith("pmaptap._host") and not n.startswith("pmaptap._host.routing")
        )
        for path, names in _imports("_trace").items()
    }
    assert {p: n for p, n in found.items() if n} == {}


def test_tap_files_are_read_without_jax(tmp_path):
    # A file copied to a laptop without JAX: the package, every tap-file
    # module and the CLI's readers still work.
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(
            f'{{"run":"r","name":"loss","step":{s},"kind":"replicated",'
            f'"value":{1.5 + s},"dtype":"float32","shape":[],"process":0,'
            '"time":0,"host":"h","replicas":8}\n'
            for s in range(2)
        )
    )
    run_python(f"""
        import sys, pkgutil
        sys.modules["jax"] = None          # any import of jax now fails
        import pmaptap, pmaptap.tapfile
        for m in pkgutil.iter_modules(pmaptap.tapfile.__path__):
            __import__("pmaptap.tapfile." + m.name)
        assert pmaptap.read({str(path)!r})[0]["value"] == 1.5
        from pmaptap.cli import main
        out = {str(tmp_path)!r}
        # Every read-only subcommand, the optional-dependency paths included.
        for cmd in (["show"], ["show", "--name", "loss", "--step", "0:1", "--json"],
                    ["tail", "-n", "1"], ["tail", "-f", "--timeout", "0.3"],
                    ["summary"], ["validate"],
                    ["plot", "--name", "loss", "--logy", "--smooth", "2",
                     "-o", out + "/p.png"],
                    ["export", "--csv", out + "/t.csv"],
                    ["export", "--parquet", out + "/t.parquet"],
                    ["export", "--tensorboard", out + "/tb"],
                    ["export", "--tensorboard", out + "/tbf", "--follow",
                     "--timeout", "0.3", "--interval", "0.1"]):
            assert main(cmd + [{str(path)!r}]) == 0, cmd
        assert "jax" not in [k for k, v in sys.modules.items() if v is not None]
        """)


def test_import_pmaptap_is_lazy_and_the_facade_lists_the_api():
    proc = run_python("""
        import sys, pmaptap
        assert "jax" not in sys.modules, "import pmaptap imported JAX"
        for name in pmaptap.__all__:
            getattr(pmaptap, name)
        assert "jax" in sys.modules
        import pmaptap as p
        print(p.__version__, sorted(p.__all__) == sorted(set(p.__all__)))
        """)
    version, unique = proc.stdout.split()
    assert unique == "True"
    from importlib.metadata import version as dist_version

    assert version == dist_version("pmaptap")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        import pmaptap

        pmaptap.nope  # noqa: B018


def test_public_submodules_are_attributes_of_the_package():
    # Scripts written like `jax.distributed.initialize()` use
    # `pmaptap.distributed.initialize()` after a bare `import pmaptap`: every
    # public submodule is an attribute, loaded on first access (it was an
    # AttributeError once the facade became lazy), and so is every module of
    # pmaptap.tapfile. The JAX-free ones load without JAX, and `import
    # pmaptap` alone still loads none of them.
    proc = run_python("""
        import pkgutil, sys
        sys.modules["jax"] = None          # any import of jax now fails
        import pmaptap
        public = sorted(m.name for m in pkgutil.iter_modules(pmaptap.__path__)
                        if not m.name.startswith("_"))
        print("PUBLIC", public)
        assert not [m for m in public if "pmaptap." + m in sys.modules]
        for name in public:
            if name == "host_callback":
                continue                   # the one that needs JAX: below
            mod = getattr(pmaptap, name)
            assert mod is sys.modules["pmaptap." + name], name
            assert name in dir(pmaptap), name
        assert sorted(pmaptap._SUBMODULES) == public, (sorted(pmaptap._SUBMODULES), public)
        assert pmaptap.distributed.launcher_settings({}) is None
        assert issubclass(pmaptap.errors.TapError, Exception)
        assert callable(pmaptap.launch.main) and callable(pmaptap.cli.main)
        assert callable(pmaptap.writer.Writer)
        tapfile = sorted(m.name for m in pkgutil.iter_modules(pmaptap.tapfile.__path__)
                         if not m.name.startswith("_"))
        assert sorted(pmaptap.tapfile._SUBMODULES) == tapfile, tapfile
        for name in tapfile:
            assert getattr(pmaptap.tapfile, name) is sys.modules["pmaptap.tapfile." + name]
        assert callable(pmaptap.tapfile.reader.read)
        assert "jax" not in [k for k, v in sys.modules.items() if v is not None]
        """)
    assert "'distributed'" in proc.stdout and "'tapfile'" in proc.stdout, proc.stdout
    # With JAX: the script of the issue, and host_callback.
    run_python("""
        import pmaptap
        assert pmaptap.distributed.initialize() == "single"
        assert callable(pmaptap.host_callback.id_tap)
        """)


def test_cli_help_needs_no_jax():
    code = (
        "import sys; sys.modules['jax'] = None; sys.argv = ['pmaptap', '--help']\n"
        "import runpy; runpy.run_module('pmaptap', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "show" in proc.stdout and "summary" in proc.stdout


def test_cli_help_imports_only_what_it_needs():
    # What kept `pmaptap --help` slow (0.43 s): NumPy, orjson and the readers
    # through cli's imports, importlib.metadata for __version__. A timing
    # bound would be flaky on a shared machine; the imports are not.
    proc = run_python("""
        import sys
        sys.argv = ["pmaptap", "--help"]
        import runpy
        try:
            runpy.run_module("pmaptap", run_name="__main__")
        except SystemExit as e:
            assert e.code == 0, e.code
        heavy = [m for m in ("numpy", "orjson", "jax", "importlib.metadata",
                             "pmaptap.tapfile.read.views", "logging")
                 if m in sys.modules]
        print("HEAVY", heavy)
        """)
    assert "HEAVY []" in proc.stdout, proc.stdout


def test_the_record_format_facts_live_in_one_place():
    # The non-finite markers and the record key are record/schema.py's (the
    # one home of the record rules); a second copy elsewhere would drift
    # (they were written out three times).
    found = []
    for rel, tree in package_sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in ("Infinity", "-Infinity"):
                found.append(f"{rel}:{node.lineno} marker {node.value!r}")
            if isinstance(node, ast.FunctionDef) and node.name == "record_key":
                found.append(f"{rel}:{node.lineno} def record_key")
    assert sorted(found) == sorted(
        [
            f"pmaptap/tapfile/record/schema.py:{_line_of('POS_INF, NEG_INF =')} marker 'Infinity'",
            f"pmaptap/tapfile/record/schema.py:{_line_of('POS_INF, NEG_INF =')} marker '-Infinity'",
            f"pmaptap/tapfile/record/schema.py:{_line_of('def record_key(')} def record_key",
        ]
    ), found


# The uses of ``__dict__`` outside tapfile/record/format.py that are not a
# Record's, by file and the object read: group.py keeps a thread-local's
# stack there (threading.local has no setdefault of its own).
_DICT_USES_ELSEWHERE = {("pmaptap/_trace/group.py", "_local")}


def test_only_format_py_touches_a_records_instance_dict():
    # Record is a frozen dataclass; its fast paths (filling a record from a
    # template, its pre-encoded line) write the instance dict directly and
    # live in record/format.py beside the fields they fill. A module that
    # reads or writes a Record's __dict__ itself (as _host/records.py once
    # did) builds records format.py cannot see or keep in step.
    found = []
    for rel, tree in package_sources():
        if rel == os.path.join("pmaptap", "tapfile", "record", "format.py"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "__dict__":
                owner = node.value.id if isinstance(node.value, ast.Name) else ast.unparse(node)
                if (rel.replace(os.sep, "/"), owner) not in _DICT_USES_ELSEWHERE:
                    found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "vars"
            ):
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def _line_of(text: str) -> int:
    with open(os.path.join(PKG, "tapfile", "record", "schema.py"), encoding="utf-8") as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def _module_graph() -> dict[str, set[str]]:
    """pmaptap module -> the pmaptap modules it imports, at module level or
    inside functions (an import on first use is still a dependency); imports
    under ``if TYPE_CHECKING:`` are left out (they never run)."""
    mods = {}
    trees = {}
    for rel, tree in package_sources():
        parts = rel[:-3].split(os.sep)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = rel
        trees[rel] = tree
    graph: dict[str, set[str]] = {}

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        out: set[str] = set()

        class Visitor(ast.NodeVisitor):
            def visit_If(self, node: ast.If) -> None:
                t = node.test
                if "TYPE_CHECKING" in (getattr(t, "id", None), getattr(t, "attr", None)):
                    for n in node.orelse:
                        self.visit(n)
                    return
                self.generic_visit(node)

            def visit_Import(self, node: ast.Import) -> None:
                out.update(resolve(a.name) for a in node.names if a.name.startswith("pmaptap"))

            def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.startswith("pmaptap"):
                    for a in node.names:
                        out.add(resolve(f"{target}.{a.name}"))

        Visitor().visit(trees[path])
        # The facade (pmaptap/__init__.py) loads public modules by name on
        # first use; a package's own __init__ is not a dependency of its
        # modules.
        graph[mod] = {m for m in out if m and m != mod and m != "pmaptap"}
    return graph


def test_no_import_circle_among_pmaptap_modules():
    graph = _module_graph()
    assert len(graph) > 50, sorted(graph)
    # Tarjan's strongly connected components: any with two or more modules
    # is a circle (modules that import each other, directly or round about).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


# tapfile's sub-packages, lowest first: each imports only those before it.
_TAPFILE_LAYERS = ("record", "source", "read", "analyze", "export")


def test_tapfile_sub_packages_are_layers_with_one_entry_each():
    """tapfile is five sub-packages, each of at most ten files. A module
    imports a module of its own sub-package freely; another sub-package
    only through its entry (``pmaptap.tapfile.<name>``, its __init__) and
    only one below its own; the rest of pmaptap only through the entries.
    So what a layer offers is the list in its __init__, and no import
    points up (from the readers to the analyses, say)."""
    tapfile = os.path.join(PKG, "tapfile")
    subs = sorted(d for d in os.listdir(tapfile) if os.path.isdir(os.path.join(tapfile, d)))
    subs = [d for d in subs if not d.startswith("__")]
    assert sorted(subs) == sorted(_TAPFILE_LAYERS)
    files = {
        d: [f for f in os.listdir(os.path.join(tapfile, d)) if f.endswith(".py")] for d in subs
    }
    assert {d: len(f) for d, f in files.items() if len(f) > 10} == {}
    assert not [f for f in os.listdir(tapfile) if f.endswith(".py") and f != "__init__.py"]
    entries = {f"pmaptap.tapfile.{d}" for d in subs}
    found = []
    for mod, deps in _module_graph().items():
        parts = mod.split(".")
        own = parts[2] if mod.startswith("pmaptap.tapfile.") else None
        for dep in sorted(deps):
            if not dep.startswith("pmaptap.tapfile."):
                continue
            layer = dep.split(".")[2]
            if layer == own:
                continue
            if dep not in entries:
                found.append(f"{mod} imports {dep}, past the entry of {layer}")
            elif own is not None and _TAPFILE_LAYERS.index(layer) > _TAPFILE_LAYERS.index(own):
                found.append(f"{mod} imports {dep}, a layer above its own")
    assert found == []


# _host's parts, and which others each may import (a sub-package only
# through its entry). The session is above the pipeline and the sinks: it
# opens a sink, starts a pipeline on it, and sets itself active in routing.
# The pipeline writes to a sink and hands what it wrote to the forwarders;
# the sinks and forwarding use nothing else of _host. Routing, the seam from
# the trace side and the output transport's drain (pmaptap/_outputs/),
# starts the console's pipeline and sink. The barrier is below them all:
# the transports register their waits with it, so it imports none; so are
# the defaults (options), which the session and the pipeline read.
_HOST_SUB_PACKAGES = ("session", "pipeline", "sinks", "forward")
_HOST_MAY_IMPORT = {
    "session": {"routing", "barrier", "options", "pipeline", "sinks", "forward"},
    "routing": {"barrier", "pipeline", "sinks"},
    "pipeline": {"options", "sinks", "forward"},
    "sinks": set(),
    "forward": set(),
    "barrier": set(),
    "options": set(),
}


def _entry_names(entry_path: str) -> set[str]:
    """The names an entry's ``__all__`` lists."""
    tree = ast.parse(open(entry_path, encoding="utf-8").read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


def test_host_sub_packages_are_layers_with_one_entry_each():
    """_host is four sub-packages (session, pipeline, sinks, forward) of at
    most ten files each, beside three modules (routing, barrier, options).
    A module imports a module of its own sub-package freely; another
    sub-package only through its entry (``pmaptap._host.<name>``, its
    __init__), and only the names its ``__all__`` lists; the rest of
    pmaptap likewise. Which part may import which is _HOST_MAY_IMPORT:
    nothing points up (the sinks or the pipeline to the session) or
    sideways (the sinks to the pipeline)."""
    host = os.path.join(PKG, "_host")
    subs = sorted(
        d for d in os.listdir(host) if os.path.isdir(os.path.join(host, d)) and d != "__pycache__"
    )
    assert subs == sorted(_HOST_SUB_PACKAGES)
    modules = sorted(f[:-3] for f in os.listdir(host) if f.endswith(".py") and f != "__init__.py")
    assert sorted(modules + subs) == sorted(_HOST_MAY_IMPORT)
    files = {d: [f for f in os.listdir(os.path.join(host, d)) if f.endswith(".py")] for d in subs}
    assert {d: len(f) for d, f in files.items() if len(f) > 10} == {}
    exported = {d: _entry_names(os.path.join(host, d, "__init__.py")) for d in subs}
    assert {d for d, names in exported.items() if not names} == set()
    found = []
    for mod, deps in _module_graph().items():
        parts = mod.split(".")
        own = parts[2] if mod.startswith("pmaptap._host.") else None
        for dep in sorted(deps):
            if not dep.startswith("pmaptap._host."):
                continue
            part = dep.split(".")[2]
            if part == own:
                continue
            if part in _HOST_SUB_PACKAGES and dep != f"pmaptap._host.{part}":
                found.append(f"{mod} imports {dep}, past the entry of {part}")
            if own is not None and part not in _HOST_MAY_IMPORT[own]:
                found.append(f"{mod} imports {dep}: {own} may not import {part}")
    # The names taken from an entry are the ones it exports.
    for rel, tree in package_sources():
        parts = rel[:-3].split(os.sep)
        own = parts[2] if parts[1] == "_host" and len(parts) > 3 else None
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            part = node.module.split(".")[2] if node.module.startswith("pmaptap._host.") else None
            if node.module == f"pmaptap._host.{part}" and part in exported and part != own:
                found += [
                    f"{rel} imports {a.name} from {node.module}, not in its __all__"
                    for a in node.names
                    if a.name not in exported[part]
                ]
    assert found == [], "\n".join(found)


def test_the_reader_modules_api_md_names_are_still_attributes_of_tapfile():
    """docs/api.md names the readers as modules of ``pmaptap.tapfile``
    (``reader``, ``views``, ``checks``, ...); since the sub-packages each is
    an attribute that loads the module that now holds it, without JAX."""
    text = open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8").read()
    i = text.index("The readers live in `pmaptap.tapfile`")
    named = re.findall(r"`(\w+)`", text[i : text.index(":", i + 40)])
    named += re.findall(r"pmaptap\.tapfile\.(\w+)", text)
    assert {"reader", "checks", "follow", "fingerprints", "arrays"} <= set(named), named
    proc = run_python(f"""
        import sys
        sys.modules["jax"] = None
        import pmaptap
        for name in {sorted(set(named))!r}:
            mod = getattr(pmaptap.tapfile, name)
            assert mod.__name__.startswith("pmaptap.tapfile."), (name, mod)
        print("OK")
        """)
    assert "OK" in proc.stdout


def test_the_seam_holds_both_ways():
    # The host side and the readers never import the trace side (what both
    # need lives in pmaptap/_common, which imports neither side); the trace
    # side reaches the host side only through routing (test above).
    graph = _module_graph()
    found = {
        m: sorted(d for d in deps if d.startswith("pmaptap._trace"))
        for m, deps in graph.items()
        if m.startswith(("pmaptap._host", "pmaptap.tapfile", "pmaptap._common"))
    }
    assert {m: d for m, d in found.items() if d} == {}
    common = {
        m: sorted(d for d in deps if d.startswith(("pmaptap._host", "pmaptap._trace")))
        for m, deps in graph.items()
        if m.startswith("pmaptap._common")
    }
    assert len(common) >= 3 and {m: d for m, d in common.items() if d} == {}


def test_the_output_transport_is_one_package_above_both_sides():
    """pmaptap/_outputs/ holds both halves of the output transport (lift,
    the wrappers, the drain); it imports the trace side and, of the host
    side, only the seam (routing) and the barrier; no other module imports
    it (the facade loads it by name on first use of pmaptap.jit)."""
    graph = _module_graph()
    outputs = {m for m in graph if m.startswith("pmaptap._outputs")}
    assert {m.rsplit(".", 1)[1] for m in outputs} >= {"lift", "jit", "later", "drain"}
    reach = {
        d
        for m in outputs
        for d in graph[m]
        if d.startswith("pmaptap._host")
        and d not in ("pmaptap._host.routing", "pmaptap._host.barrier")
    }
    assert reach == set()
    users = {
        m
        for m, deps in graph.items()
        if m not in outputs and any(d.startswith("pmaptap._outputs") for d in deps)
    }
    assert users == set(), users


def test_every_exception_is_defined_in_errors_py():
    """One home for exceptions: a class deriving from an exception (a
    built-in one or pmaptap's) is defined in pmaptap/errors.py only (the
    readers' MissingBytes lived in tapfile/arrays.py; it is still imported
    there, where callers may have imported it from)."""
    import builtins

    sources = package_sources()
    ours = {
        node.name
        for rel, tree in sources
        if rel == os.path.join("pmaptap", "errors.py")
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }
    assert {"TapError", "AssembleError", "MissingBytes"} <= ours

    def is_exception(base: ast.expr) -> bool:
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
        known = getattr(builtins, name, None)
        return name in ours or (isinstance(known, type) and issubclass(known, BaseException))

    elsewhere = [
        f"{rel}: {node.name}"
        for rel, tree in sources
        if rel != os.path.join("pmaptap", "errors.py")
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and any(is_exception(b) for b in node.bases)
    ]
    assert elsewhere == []
    from pmaptap import errors
    from pmaptap.tapfile import arrays

    assert arrays.MissingBytes is errors.MissingBytes


def test_the_code_does_not_point_at_the_issue_tracker():
    """Comments and docstrings say why in their own words; an issue number
    means nothing to a reader of the code (nor outside this tracker)."""
    import re

    pattern = re.compile(r"\bissues? ?#?\d+|/issues/\d+", re.IGNORECASE)
    found = []
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith((".py", ".c")):
                path = os.path.join(dirpath, f)
                for n, line in enumerate(open(path, encoding="utf-8"), 1):
                    if pattern.search(line):
                        found.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_pmaptap_is_pure_python_and_builds_a_pure_wheel_without_a_compiler(tmp_path):
    """No compiled source in the package and no setup.py (issue 39: the C
    extension is gone); ``pip wheel .`` with no C compiler to be found
    (CC=false) gives a ``py3-none-any`` wheel."""
    compiled = (".c", ".h", ".cc", ".cpp", ".pyx", ".pxd", ".so", ".pyd")
    found = [
        os.path.relpath(os.path.join(d, f), ROOT)
        for d, _, files in os.walk(PKG)
        for f in files
        if f.endswith(compiled)
    ]
    assert found == [] and not os.path.exists(os.path.join(ROOT, "setup.py")), found
    env = dict(os.environ, CC="false", CXX="false", PIP_NO_INDEX="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["-q", "-w", str(tmp_path / "dist"), ROOT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheels = os.listdir(tmp_path / "dist")
    assert len(wheels) == 1 and wheels[0].endswith("-py3-none-any.whl"), wheels
    # The license the package declares (Apache-2.0) is in the checkout and
    # travels in the wheel.
    import zipfile

    with zipfile.ZipFile(tmp_path / "dist" / wheels[0]) as z:
        names = z.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        (lic,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert "License-Expression: Apache-2.0" in z.read(meta).decode()
        text = z.read(lic).decode()
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        assert f.read() == text
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
