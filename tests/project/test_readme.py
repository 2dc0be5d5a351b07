"""The README's ten-line example runs and prints what it says; its test
command is what CI runs; it stays short, and every relative link in it and
in docs/ reaches an existing file and heading."""

from __future__ import annotations

import glob
import os
import re

from conftest import ROOT, run_python


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_readme_example_runs_as_documented(tmp_path):
    text = _read("README.md")
    code = text.split("## Ten lines\n\n```python\n", 1)[1].split("```", 1)[0]
    expected = re.search(r"^# (\[.*?\]):", code, re.M).group(1)
    code = code.replace('"out/run.jsonl"', repr(str(tmp_path / "run.jsonl")))
    # Twice on one file, as a user reruns it: the file is appended to, and
    # the example reads back its own run (it printed six losses the second
    # time when it read the whole file).
    for _ in range(2):
        proc = run_python(code, devices=4)
        assert proc.stdout.strip() == expected
    import pmaptap

    assert len(pmaptap.read(tmp_path / "run.jsonl", name="loss")) == 6


def test_readme_test_command_is_what_ci_runs():
    text = _read("README.md")
    block = text.split("Run the tests", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    ci = [
        line
        for line in _read(".ci/run").splitlines()
        if line.strip() and not line.startswith(("#", "set ", "cd "))
    ]
    assert block.strip() == " && ".join(ci)


def _slug(heading: str) -> str:
    # GitHub's anchor for a heading: lower case, punctuation dropped.
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(path: str) -> set[str]:
    out, code = set(), False
    for line in _read(path).splitlines():
        if line.startswith("```"):
            code = not code
        elif not code and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def test_readme_is_short_and_links_into_docs_resolve():
    assert len(_read("README.md").encode()) < 15_000
    pages = ["README.md"] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
    )
    for name in (
        "api",
        "architecture",
        "cli",
        "contributing",
        "faults",
        "host_callback",
        "multihost",
        "performance",
    ):
        assert f"docs/{name}.md" in pages
        assert f"(docs/{name}.md" in _read("README.md"), name
    bad = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", _read(page)):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(ROOT, dest)):
                bad.append(f"{page}: {target} (no such file)")
            elif anchor and dest.endswith(".md") and anchor not in _headings(dest):
                bad.append(f"{page}: {target} (no such heading)")
    assert bad == []
