"""docs/architecture.md draws the code: every file it names exists, and every
``file.py: name`` it points at is defined in that file. A rename or a move
that forgets the drawing fails here instead of misleading the next reader."""

from __future__ import annotations

import ast
import os
import re

from conftest import ROOT

DOC = os.path.join(ROOT, "docs", "architecture.md")
# A file (with an optional directory part) and, after ": ", the names it
# defines: "tap.py: tap -> send", "group.py: auto_offer", "sink.py".
REF = re.compile(
    r"(?<![\w/.])((?:[\w]+/)*[\w]+\.py)(?::\s+((?:[A-Za-z_][\w.]*)(?:\s*(?:->|/|,)\s*[A-Za-z_][\w.]*)*))?"
)
SEARCHED = ("pmaptap", "tests", "benchmarks", "launch")


def _files() -> dict[str, list[str]]:
    """basename -> repository-relative paths of the .py files with that name."""
    out: dict[str, list[str]] = {}
    for top in SEARCHED:
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    out.setdefault(f, []).append(os.path.relpath(os.path.join(d, f), ROOT))
    return out


def _resolve(ref: str, files: dict[str, list[str]]) -> list[str]:
    """The files a reference can mean: a path as written (from the root or
    from pmaptap/), else every file whose path ends with it."""
    for base in ("", "pmaptap"):
        if os.path.isfile(os.path.join(ROOT, base, ref)):
            return [os.path.normpath(os.path.join(base, ref))]
    name = os.path.basename(ref)
    return [p for p in files.get(name, []) if p.endswith(os.sep + ref) or p == ref]


def _defined(path: str) -> set[str]:
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_every_file_and_name_the_architecture_draws_exists():
    text = open(DOC, encoding="utf-8").read()
    files = _files()
    wrong = []
    seen = 0
    for m in REF.finditer(text):
        ref, names = m.group(1), m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        where = _resolve(ref, files)
        seen += 1
        if len(where) != 1:
            wrong.append(f"line {line}: {ref} names {len(where)} files {where}")
            continue
        for name in re.split(r"\s*(?:->|/|,)\s*", names or ""):
            # "Class.method" is checked by its class; a name is defined in
            # the file (def, class or assignment).
            if name and name.split(".")[0] not in _defined(where[0]):
                wrong.append(f"line {line}: {where[0]} defines no {name.split('.')[0]!r}")
    assert seen > 60, seen
    assert wrong == []
