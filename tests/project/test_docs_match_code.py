"""docs/architecture.md draws the code: every file it names exists, and every
``file.py: name`` it points at is defined in that file (``Class.member`` in
that class). A rename or a move
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


def _names(nodes) -> set[str]:
    """The names these statements define: def, class, assignment."""
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _defined(path: str) -> set[str]:
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    return _names(ast.walk(tree))


def _members(path: str) -> dict[str, set[str]]:
    """class -> the names its body defines, and those of its bases defined
    in the same file (methods, properties, class attributes)."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    own: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            own.setdefault(node.name, set()).update(_names(node.body))
            bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def every(cls: str, seen: frozenset = frozenset()) -> set[str]:
        out = set(own.get(cls, ()))
        for b in bases.get(cls, ()):
            if b not in seen:
                out |= every(b, seen | {cls})
        return out

    return {cls: every(cls) for cls in own}


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
            # A name is defined in the file (def, class or assignment);
            # "Class.member" is defined in that class (or a base in the file).
            if not name:
                continue
            top, _, member = name.partition(".")
            if top not in _defined(where[0]):
                wrong.append(f"line {line}: {where[0]} defines no {top!r}")
            elif member and member.split(".")[0] not in _members(where[0]).get(top, ()):
                wrong.append(f"line {line}: {where[0]}: {top} defines no {member!r}")
    assert seen > 60, seen
    assert wrong == []
