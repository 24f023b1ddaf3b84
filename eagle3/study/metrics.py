"""Drift metrics between two deployments' hidden states and next-token distributions.

Every function takes the two deployments' tensors for the *same* token sequence
(``a`` is the reference of the pair, e.g. the BF16 parent) and returns per-token values;
:class:`PairAccumulator` sums them over many sequences and layers so that the study
never holds more than one sequence's logits at a time. All arithmetic is float64 on
whatever the inputs were computed in, so the metric itself adds no rounding worth
reporting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def cosine_per_token(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``cos(a[t], b[t])`` for each token: ``[T]`` float64 from two ``[T, H]`` tensors.

    A zero vector on either side gives cosine 0 (never NaN).
    """
    a, b = a.double(), b.double()
    den = a.norm(dim=-1) * b.norm(dim=-1)
    return torch.where(den > 0, (a * b).sum(-1) / den.clamp_min(1e-300), torch.zeros_like(den))


def relative_l2_per_token(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``||b[t] - a[t]|| / ||a[t]||`` for each token: ``[T]`` float64 from two ``[T, H]`` tensors.

    ``a`` is the reference (the denominator); a zero reference vector gives 0 when ``b``
    is zero too and ``inf`` otherwise.
    """
    a, b = a.double(), b.double()
    num, den = (b - a).norm(dim=-1), a.norm(dim=-1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, torch.inf, 0.0))


def top1_agreement_per_token(logits_a: torch.Tensor, logits_b: torch.Tensor) -> torch.Tensor:
    """``argmax logits_a[t] == argmax logits_b[t]``: ``[T]`` bool from two ``[T, V]`` tensors.

    Ties go to the lowest token id (``torch.argmax``), on both sides alike.
    """
    return logits_a.argmax(-1) == logits_b.argmax(-1)


def kl_per_token(logits_a: torch.Tensor, logits_b: torch.Tensor) -> torch.Tensor:
    """``KL(p_a[t] || p_b[t])`` in nats for each token: ``[T]`` float64 from ``[T, V]`` logits.

    ``p = softmax(logits)`` over the full vocabulary; the reference ``a`` is the
    distribution the expectation is taken under.
    """
    la = torch.log_softmax(logits_a.double(), dim=-1)
    lb = torch.log_softmax(logits_b.double(), dim=-1)
    return (la.exp() * (la - lb)).sum(-1)


@dataclass
class PairAccumulator:
    """Running sums of one pair's per-token metrics over sequences.

    ``layers`` are the hidden-state ids (HF ``output_hidden_states`` indices) measured;
    :meth:`add` takes one sequence's ``[L+1, T, H]`` states of both sides (indexed by
    those ids) and their ``[T, V]`` logits, over the positions selected by ``mask``
    ``[T]`` bool (e.g. the positions whose next token is a reply token).
    """

    layers: list[int]
    tokens: int = 0
    cos_sum: dict = field(default_factory=dict)
    rel_sum: dict = field(default_factory=dict)
    cos_min: dict = field(default_factory=dict)
    agree: int = 0
    kl_sum: float = 0.0

    def add(self, states_a, states_b, logits_a, logits_b, mask: torch.Tensor) -> None:
        """Add one sequence (see the class docstring for shapes)."""
        n = int(mask.sum())
        if n == 0:
            return
        self.tokens += n
        for k in self.layers:
            cos = cosine_per_token(states_a[k][mask], states_b[k][mask])
            rel = relative_l2_per_token(states_a[k][mask], states_b[k][mask])
            self.cos_sum[k] = self.cos_sum.get(k, 0.0) + float(cos.sum())
            self.rel_sum[k] = self.rel_sum.get(k, 0.0) + float(rel.sum())
            self.cos_min[k] = min(self.cos_min.get(k, 1.0), float(cos.min()))
        self.agree += int(top1_agreement_per_token(logits_a[mask], logits_b[mask]).sum())
        self.kl_sum += float(kl_per_token(logits_a[mask], logits_b[mask]).sum())

    def summary(self) -> dict:
        """``{tokens, cosine: {layer: mean}, cosine_min, rel_l2: {layer: mean}, top1_agreement, mean_kl}``.

        Layer keys are strings (JSON); means are over tokens; ``cosine_min`` is the
        smallest per-token cosine seen at each layer.
        """
        n = max(self.tokens, 1)
        return {
            "tokens": self.tokens,
            "cosine": {str(k): self.cos_sum.get(k, 0.0) / n for k in self.layers},
            "cosine_min": {str(k): self.cos_min.get(k, 1.0) for k in self.layers},
            "rel_l2": {str(k): self.rel_sum.get(k, 0.0) / n for k in self.layers},
            "top1_agreement": self.agree / n,
            "mean_kl": self.kl_sum / n,
        }
