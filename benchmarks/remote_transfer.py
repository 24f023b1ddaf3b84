"""Bytes a second through engine=remote's transfer engine (a Mooncake store, hs-connectors' layout).

    python benchmarks/remote_transfer.py --hidden 7168 --tokens 2048 --samples 16 --rounds 3

A Mooncake master and a producer process (what the capture node does after its forward:
:func:`eagle3.engines.remote.transfer.publish` of ``[T, 3, H]`` bf16 aux states and ``[T, 20]``
top-k per sample) on 127.0.0.1; this process reads each sample back with
:func:`~eagle3.engines.remote.transfer.fetch` (wait, copy out, remove). Prints per round the
producer's and the reader's GB/s and tokens/s, then the median and min-max of the reader's
rates. ``--hidden 7168`` is Kimi-K2.5's width (43 KB a token); ``576`` the embedded target's.
Over TCP on one host this is the loopback's and the CPUs' rate, not a network's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def produce(a) -> None:
    """Producer role: publish ``--samples`` captures, print one JSON line of manifests and seconds."""
    import torch

    from eagle3.engines.remote.transfer import open_store, publish
    from eagle3.features import Capture

    store = open_store(a.master, segment_mb=a.segment_mb)
    g = torch.Generator().manual_seed(0)
    cap = Capture(torch.randn(a.tokens, 3, a.hidden, generator=g).bfloat16(),
                  torch.randint(0, 1000, (a.tokens, 20), dtype=torch.int32), torch.randn(a.tokens, 20))
    for r in range(a.rounds):
        t0 = time.perf_counter()
        ms = [publish(store, f"r{r}/{i}", cap) for i in range(a.samples)]
        print(json.dumps({"seconds": time.perf_counter() - t0, "manifests": ms}), flush=True)
        sys.stdin.readline()  # the reader has read this round


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens a sample")
    ap.add_argument("--samples", type=int, default=16, help="samples a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--segment-mb", type=int, default=4096)
    ap.add_argument("--role", default="reader", choices=("reader", "producer"))
    ap.add_argument("--master", default=None)
    a = ap.parse_args(argv)
    if a.role == "producer":
        return produce(a)
    from mooncake_env import child_env, import_mooncake, start_master  # tests/: the unpacked-library preload

    from eagle3.engines.remote.transfer import fetch, open_store

    try:
        import_mooncake()
    except ImportError as e:
        raise SystemExit(f"Mooncake is not importable: {e}; run scripts/install-mooncake-cpu.sh") from None
    mproc, master = start_master()
    errors = tempfile.TemporaryFile(mode="w+")
    prod = subprocess.Popen([sys.executable, __file__, "--role", "producer", "--master", master] + (argv or sys.argv[1:]),
                            env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True)
    try:
        store = open_store(master, segment_mb=256, buffer_mb=max(512, a.tokens * a.hidden * 6 >> 20))
        nbytes = a.tokens * (3 * a.hidden * 2 + 20 * 8)
        reads = []
        for r in range(a.rounds):
            raw = prod.stdout.readline()
            if not raw.startswith("{"):
                errors.seek(0)
                tail = [ln for ln in errors.read().splitlines() if not ln[:1] in "IW"][-15:]
                raise SystemExit(f"the producer failed (exit {prod.poll()}): {raw!r}\n" + "\n".join(tail))
            line = json.loads(raw)
            t0 = time.perf_counter()
            for m in line["manifests"]:
                fetch(store, m)
            dt = time.perf_counter() - t0
            prod.stdin.write("\n")
            prod.stdin.flush()
            total = nbytes * a.samples
            reads.append(total / dt)
            print(f"round {r}: publish {total / line['seconds'] / 1e9:.2f} GB/s "
                  f"({a.tokens * a.samples / line['seconds']:,.0f} tokens/s) | read {total / dt / 1e9:.2f} GB/s "
                  f"({a.tokens * a.samples / dt:,.0f} tokens/s)")
        print(f"read: median {statistics.median(reads) / 1e9:.2f} GB/s (min {min(reads) / 1e9:.2f}, max "
              f"{max(reads) / 1e9:.2f}) over {a.rounds} rounds of {a.samples} x {a.tokens} tokens, "
              f"{nbytes / a.tokens:,.0f} B a token, {os.cpu_count()} CPUs")
    finally:
        for p in (prod, mproc):
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
