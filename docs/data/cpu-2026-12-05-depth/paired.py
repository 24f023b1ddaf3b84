"""Paired difference of served tau, two drafters on the same prompts (the speculative requests of
two evaluate.py engine=vllm runs): per benchmark, pooled tau of each and a bootstrap 95% interval
of the difference over prompts.  python paired.py <eval A folder> <eval B folder>"""
import json
import random
import sys


def load(folder):
    out = {}
    for line in open(f"{folder}/vllm_requests.jsonl"):
        r = json.loads(line)
        if r.get("role") == "speculative" and r.get("phase") == "batch1":
            out[(r["benchmark"], r["sample_id"], r["turn"])] = (r["drafts"], r["accepted"])
    return out


a, b = load(sys.argv[1]), load(sys.argv[2])
for bench in sorted({k[0] for k in a}):
    keys = sorted(k for k in a if k[0] == bench and k in b)
    tau = lambda d, ks: 1 + sum(d[k][1] for k in ks) / sum(d[k][0] for k in ks)
    rng = random.Random(0)
    diffs = sorted(tau(b, s) - tau(a, s) for s in ([rng.choice(keys) for _ in keys] for _ in range(2000)))
    print(f"{bench}: {len(keys)} prompts, tau {tau(a, keys):.3f} -> {tau(b, keys):.3f}, difference "
          f"{tau(b, keys) - tau(a, keys):+.3f} [{diffs[50]:+.3f}, {diffs[1949]:+.3f}]")
