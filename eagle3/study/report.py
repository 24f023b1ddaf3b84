"""The drift study's printed table and its plot (cosine per hidden-state id, one line per pair)."""

from __future__ import annotations

import os
from pathlib import Path


def format_table(result: dict, scope: str = "reply") -> str:
    """A fixed-width text table of ``result`` (:func:`eagle3.study.drift.measure_drift`'s
    output under ``result["pairs"]``, aux ids under ``result["aux_layer_ids"]``) in ``scope``:
    per pair, cosine and relative L2 at each aux id, top-1 agreement, mean KL; then the
    served-kernel rows of ``result["served"]`` when present."""
    aux = [str(k) for k in result["aux_layer_ids"]]
    head = ["pair (a:b)", "tokens"] + [f"cos@{k}" for k in aux] + [f"relL2@{k}" for k in aux] + ["top1", "KL(a||b)"]
    rows = [head]
    for pair, scopes in result["pairs"].items():
        s = scopes[scope]
        rows.append([pair, str(s["tokens"])] + [f"{s['cosine'][k]:.5f}" for k in aux]
                    + [f"{s['rel_l2'][k]:.4f}" for k in aux]
                    + [f"{100 * s['top1_agreement']:.1f}%", f"{s['mean_kl']:.4f}"])
    for name, sv in (result.get("served") or {}).items():
        s = sv[scope]
        rows.append([name, str(s["tokens"])] + ["-"] * (2 * len(aux)) + [f"{100 * s['top1_agreement']:.1f}%", "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_cosine(result: dict, path, scope: str = "reply") -> Path:
    """Write a PNG of the mean cosine per hidden-state id for every pair (log scale of
    ``1 - cosine``, aux ids marked) to ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for pair, scopes in result["pairs"].items():
        cos = scopes[scope]["cosine"]
        ks = sorted(int(k) for k in cos)
        ys = [max(1.0 - cos[str(k)], 1e-9) for k in ks]
        ax.plot(ks, ys, marker="o", ms=3, label=pair)
    for k in result["aux_layer_ids"]:
        ax.axvline(k, color="grey", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("hidden-state id (HF output_hidden_states; dashed: aux layers)")
    ax.set_ylabel("1 - mean cosine (floor 1e-9 = identical)")
    ax.set_title(f"{result.get('target', 'target')}: feature drift per layer ({result.get('compute_dtype')}, "
                 f"{scopes[scope]['tokens']} {scope} tokens)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)  # atomic: a reader never sees half a PNG
    return path
