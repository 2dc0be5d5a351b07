"""Check pmaptap's inventory of JAX internals against a JAX source tree,
without installing it: every ``jax._src`` module pmaptap imports must be a
file (or package) there, and every attribute pmaptap reads from it a name
the module defines at its top level (a def, class, assignment or import).

    python scripts/check_jax_source.py --git /path/to/jax/.git [--rev HEAD]
    python scripts/check_jax_source.py /path/to/jax-checkout

Exit status 0 when everything is there; else each missing name is printed
with where pmaptap uses it. This is the "statically checked" of
docs/contributing.md#jax-versions: names exist, behaviour is not tested.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _reader(args: argparse.Namespace):
    if args.git:

        def read(path: str) -> str | None:
            out = subprocess.run(
                ["git", "--git-dir", args.git, "show", f"{args.rev}:{path}"],
                capture_output=True,
                text=True,
            )
            return out.stdout if out.returncode == 0 else None

        return read

    def read_file(path: str) -> str | None:
        try:
            with open(os.path.join(args.src, path), encoding="utf-8") as f:
                return f.read()
        except OSError:
            return None

    return read_file


def _names_of(text: str) -> set[str]:
    try:
        return _top_level_names(ast.parse(text))
    except SyntaxError:
        # Newer syntax than this Python parses (JAX 0.11 needs Python 3.12:
        # PEP 695 generics): the definitions by their line shapes instead.
        return _names_by_lines(text)


def _names_by_lines(text: str) -> set[str]:
    import re

    names: set[str] = set()
    for m in re.finditer(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", text, re.M):
        names.add(m.group(1))
    for m in re.finditer(r"^\s*(\w+)\s*(?::[^=\n]*)?=(?!=)", text, re.M):
        names.add(m.group(1))
    for m in re.finditer(r"^\s*(?:from\s+\S+\s+)?import\s+([^\n(]+|\([^)]*\))", text, re.M):
        for part in m.group(1).strip("()").split(","):
            part = part.strip().split(" as ")[-1].strip()
            if part:
                names.add(part.split(".")[0])
    return names


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):  # conditional definitions (try/if) count too
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                names.add((a.asname or a.name).split(".")[0])
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", nargs="?", help="a JAX checkout (the folder holding jax/)")
    p.add_argument("--git", help="a JAX git directory, read with git show")
    p.add_argument("--rev", default="HEAD")
    args = p.parse_args(argv)
    if not args.src and not args.git:
        p.error("give a JAX checkout or --git DIR")
    read = _reader(args)
    version = read("jax/version.py") or ""
    line = [x for x in version.splitlines() if x.startswith("_version =")]
    print(f"JAX source: {line[0].split('=')[1].strip() if line else '?'}")

    from pmaptap._trace import jax_support

    uses = jax_support.internal_uses()
    wanted = sorted(uses, key=lambda k: (k[0], k[1] or ""))
    wanted += [(m, fn) for m, fn in jax_support.DIVERGENT_FLOW]
    wanted += [(m, None) for m in jax_support.MESH_FRAME_MODULES]
    cache: dict[str, set[str] | None] = {}
    missing = []
    for mod, attr in wanted:
        path = mod.replace(".", "/")
        if mod not in cache:
            text = read(path + ".py") or read(path + "/__init__.py")
            cache[mod] = None if text is None else _names_of(text)
        names = cache[mod]
        where = uses.get((mod, attr), ["placement.py (by name)"])[:3]
        if names is None:
            # A compiled module (jaxlib's) has no source here: not checkable.
            if not mod.startswith("jax._src.lib"):
                missing.append(f"module {mod}; used at {where}")
            continue
        if attr is not None and attr not in names and read(f"{path}/{attr}.py") is None:
            missing.append(f"{mod}.{attr}; used at {where}")
    print(f"{len(wanted)} uses checked, {len(missing)} missing")
    for m in missing:
        print("  missing:", m)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
