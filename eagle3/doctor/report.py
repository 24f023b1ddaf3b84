"""The doctor's printed checklist and its ``doctor.json``.

The table is plain text, one row per check: status (``PASS`` / ``FAIL`` / ``WARN`` /
``SKIP``), the check's name and what it found, with a ``fix:`` line under every failed or
warned row; the last line counts the failures and gives the exit code (1 when any check
failed, else 0). ``doctor.json`` (written atomically, :func:`eagle3.io.write_json_atomic`)
holds the same rows, the probe's measures and the settings.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from eagle3.io import write_json_atomic

DOCTOR_FILE = "doctor.json"
WIDTH = 110
_NAME_W = 24


def exit_code(rows: list[dict]) -> int:
    """1 when any row failed, else 0."""
    return 1 if any(r["status"] == "fail" for r in rows) else 0


def format_table(rows: list[dict], title: str, context: list[str]) -> str:
    """The checklist as text.

    Args:
        rows: ``{name, status, detail, fix}`` rows (:func:`eagle3.doctor.checks.row`).
        title: the first line (the export being diagnosed).
        context: lines printed under the title (target, serving engine).
    """
    pad = " " * (6 + _NAME_W)
    out = [title] + [f"  {c}" for c in context] + [""]
    for r in rows:
        head = f"{r['status'].upper():<6}{r['name']:<{_NAME_W}}"
        out += textwrap.wrap(r["detail"], WIDTH, initial_indent=head, subsequent_indent=pad) or [head]
        if r["fix"] and r["status"] in ("fail", "warn"):
            out += textwrap.wrap(r["fix"], WIDTH, initial_indent=pad + "fix: ", subsequent_indent=pad + "     ")
    n = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "warn", "skip")}
    out += ["", f"{n['fail']} failed, {n['warn']} warned, {n['pass']} passed, {n['skip']} skipped: "
                f"exit {exit_code(rows)}"]
    return "\n".join(out)


def write_doctor_json(output_dir: Path, doc: dict) -> Path:
    """Write ``doc`` to ``<output_dir>/doctor.json`` atomically; returns the path."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / DOCTOR_FILE
    write_json_atomic(path, doc)
    return path
