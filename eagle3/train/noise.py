"""Feature noise for training (``drafter.feature_noise``): a regulariser on the aux hidden states.

EAGLE (Li et al., 2024) adds uniform noise to the target features it trains on; the three
EAGLE-3 aux layers differ in magnitude by orders of magnitude, so here the noise is Gaussian
with a standard deviation relative to each aux state's RMS. Applied by
:class:`eagle3.train.ttt.TTTModel` while the drafter is in training mode, never in
validation or serving. Each micro-batch draws from its own generator, seeded by
:func:`noise_seed` from its global index, so a resumed run draws what the uninterrupted one did.
"""

from __future__ import annotations

from typing import Optional

import torch


def add_feature_noise(aux: torch.Tensor, sigma: float, seed: Optional[int] = None, num_aux: int = 3) -> torch.Tensor:
    """``aux [B, T, num_aux * Ht]`` plus Gaussian noise of standard deviation ``sigma`` times the
    RMS of each aux state (per token and aux layer), in ``aux``'s dtype. The RMS is taken on
    the state divided by its absmax, so no finite state overflows float32. ``seed`` (a
    generator on ``aux``'s device; None = torch's global one) makes the draws reproducible: training seeds
    one per micro-batch (:class:`eagle3.train.ttt.TTTModel`'s ``noise_seed``), so a resumed run and any split of
    the global batch over processes draw the same noise."""
    B, T, D = aux.shape
    x = aux.float().view(B, T, num_aux, D // num_aux)
    amax = x.abs().amax(-1, keepdim=True)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    rms = (x / amax).pow(2).mean(-1, keepdim=True).sqrt() * amax
    generator = None if seed is None else torch.Generator(device=aux.device).manual_seed(int(seed))
    noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    return (x + noise * rms * sigma).view(B, T, D).to(aux.dtype)


def noise_seed(seed: int, epoch: int, micro_batch: int) -> int:
    """The feature-noise generator seed of global micro-batch ``micro_batch`` of ``epoch``
    (:class:`eagle3.train.ttt.TTTModel`): the same on a resume and for any process count."""
    return ((((int(seed) % 2**23) << 16 | int(epoch) % 2**16) << 24) | int(micro_batch) % 2**24)  # < 2**63
