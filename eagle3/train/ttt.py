"""Training-time test (TTT): unrolled drafting, its loss and its metrics.

Indexing (one sample of length ``T``; position ``p`` of a capture holds the target's
state at token ``p`` and its distribution of token ``p+1``, see docs/design.md):

* Row ``r`` of step ``j`` is the ``j``-th draft step of a chain that starts after
  token ``r``: its input token is ``x[r+1+j]``, its position ``r+j``, its hidden input
  the target's fused aux states at ``r`` (``j = 0``) or the drafter's own output of
  step ``j-1`` at row ``r`` (``j > 0``).
* It predicts token ``x[r+2+j]``; the target distribution is the stored top-k at
  position ``p = r+1+j``. The row carries loss iff ``r+2+j < T``,
  ``loss_mask[r+2+j] == 1`` (the label is a token the target generated: the loss
  mask shifted together with the labels) and the target's argmax at ``p`` lies in the
  draft vocabulary.
* Attention: step ``j`` at row ``r`` sees the step-0 keys of rows ``0..r`` (the
  target-feature cache of the prefix) and the keys of steps ``1..j`` at row ``r``
  only (its own chain), exactly what drafting after token ``r`` sees at serving
  time. The keys of all steps are concatenated and one explicit bool mask per step
  selects them (the formulation of SpecForge / speculators). Steps ``j >= 1`` run only
  on the rows that carry loss at some step ``>= 1`` (see :class:`TTTCollator`): a
  row's chain never affects another row, so the others (prompt rows) are skipped.
  With ``chain_chunk`` set, steps ``j >= 1`` attend chunk by chunk of chain rows
  instead (:class:`eagle3.train.ttt_attention.ChainMask`): each chunk's queries get only the step-0 keys up to
  the chunk's last row and their own rows' chain keys, so the masked-out keys of the
  other rows' chains are never computed. Same visible keys, same softmax: equal to
  the dense mask up to float rounding (``tests/test_ttt.py``).

Loss (EAGLE-3; float32 whatever the autocast dtype): forward KL from the target's
top-k distribution, restricted to the draft vocabulary and renormalised, to the
drafter's log-softmax, averaged over the step's loss rows, weighted
``step_weight**j`` and summed over steps.

Metrics per step ``j``: mean KL, top-1 agreement of the drafter's argmax with the
target's argmax on the loss rows; and the simulated acceptance length of a chain of
``ttt_steps`` drafts: ``tau = 1 + mean_r sum_j prod_{i<=j} correct_i[r]`` over chain
starts ``r`` whose first label is a generated token (an out-of-vocabulary or
unmasked step ends the chain).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn
from transformers import DynamicCache

from eagle3.model.drafter import Eagle3Drafter
from eagle3.train.loss import fused_topk_kl, kl_loss, target_distribution  # noqa: F401  (re-exported)
from eagle3.train.noise import add_feature_noise
from eagle3.train.ttt_attention import chain_attention, ttt_attention_mask  # noqa: F401  (ttt_attention_mask: re-exported)


# ------------------------------------------------------------------ pure helpers
def step_input_ids(input_ids: torch.Tensor, step: int) -> torch.Tensor:
    """``[B, T]`` -> ``[B, T]``: row ``r`` holds ``x[r+1+step]`` (0 past the end)."""
    s = step + 1
    out = torch.zeros_like(input_ids)
    if s < input_ids.shape[1]:
        out[:, : input_ids.shape[1] - s] = input_ids[:, s:]
    return out


def target_to_draft_index(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[V]`` int64: the draft id of each target id, ``-1`` outside the draft vocabulary."""
    idx = torch.full((vocab_size,), -1, dtype=torch.int64, device=d2t.device)
    n = d2t.shape[0]
    idx[torch.arange(n, device=d2t.device) + d2t] = torch.arange(n, device=d2t.device)
    return idx


def chain_acceptance(hits: Sequence[torch.Tensor], chain_starts: torch.Tensor) -> torch.Tensor:
    """Accepted draft steps per chain: ``sum_j prod_{i<=j} hits[i]`` where a chain starts.

    Args:
        hits: per step ``[R]`` bool, the drafter's argmax equals the target's.
        chain_starts: ``[R]`` bool, rows whose first label is a generated token.

    Returns:
        ``[R]`` float32 (0 outside chain starts); the simulated tau is
        ``1 + accepted[chain_starts].mean()``.
    """
    run = chain_starts.clone()
    accepted = torch.zeros(chain_starts.shape, dtype=torch.float32, device=chain_starts.device)
    for h in hits:
        run &= h
        accepted += run
    return accepted


# ------------------------------------------------------------------- batching
class TTTCollator:
    """DataLoader ``collate_fn``: records -> one right-padded TTT batch.

    Everything that depends only on the data (loss rows of every step, the target
    distributions on them, chain starts) is computed here on the CPU, so the device
    never has to wait for index computations.

    Args:
        t2d_index: ``[V]`` CPU int64 from :func:`target_to_draft_index`.
        ttt_steps: number of TTT steps ``J``.
        max_length: samples are cut to this many tokens.
        pad_multiple: the padded length is a multiple of this.
        target_temperature: of ``target_q`` (:func:`eagle3.train.loss.target_distribution`).

    Steps ``j >= 1`` only run on *chain rows*: the rows that carry loss at some step
    ``>= 1`` (rows inside prompts never do), gathered per sample into a compact
    ``[B, T']`` layout. Step 0 runs on every row (its keys are the prefix cache).

    The returned dict has ``input_ids [B, T]`` int64, ``aux_hidden_states
    [B, T, 3*H]`` bf16, ``lengths [B]``, ``chain_rows [B, T']`` int64 (row of each
    compact slot, 0 in padding slots), per step ``rows`` (``[N_j]`` flat indices of
    the loss rows: ``b*T + r`` at step 0, ``b*T' + slot`` after), ``rows_full``
    (the same rows as ``b*T + r``), ``target_ids`` (``[N_j, k]`` draft ids),
    ``target_q`` (``[N_j, k]`` float32), ``chain_starts [B*T]`` bool, and counts
    ``num_tokens``, ``num_chains``, ``skipped_nonfinite``, ``sample_ids``.
    """

    def __init__(self, t2d_index: torch.Tensor, ttt_steps: int, max_length: int, pad_multiple: int = 1,
                 target_temperature: float = 1.0):
        self.t2d_index = t2d_index.cpu()
        self.target_temperature = float(target_temperature)
        self.ttt_steps = int(ttt_steps)
        self.max_length = int(max_length)
        self.pad_multiple = max(1, int(pad_multiple))

    @staticmethod
    def is_finite(sample: dict) -> bool:
        """False when the aux states hold NaN/Inf or the log-probs NaN/+Inf."""
        aux = sample["aux_hidden_states"]
        # NaN propagates through aminmax and +-Inf is an extreme: ~6x faster than isfinite().all()
        bad_aux = aux.numel() > 0 and not bool(torch.isfinite(torch.stack(torch.aminmax(aux))).all())
        lp = sample["topk_logprobs"]
        return not bad_aux and not bool((torch.isnan(lp) | (lp == float("inf"))).any())

    @staticmethod
    def stand_in(sample: dict) -> dict:
        """A loss-free copy of ``sample``: zero aux states and log-probs, no loss-masked token."""
        return {**sample, "aux_hidden_states": torch.zeros_like(sample["aux_hidden_states"]),
                "topk_logprobs": torch.zeros_like(sample["topk_logprobs"]),
                "loss_mask": torch.zeros_like(sample["loss_mask"])}

    def __call__(self, samples: Sequence[dict]) -> dict[str, Any]:
        """Collate feature records (``FeatureDataset`` items) into the batch dict described above.

        When every sample has non-finite features the batch holds one loss-free :meth:`stand_in`
        (``sample_ids`` empty): its forward and backward pass give zero loss and zero gradients, so
        with several processes this one still joins the gradient all-reduce its peers wait in."""
        good = [s for s in samples if self.is_finite(s)]
        skipped = len(samples) - len(good)
        sample_ids = [s.get("sample_id") for s in good]
        if not good and samples:
            good = [self.stand_in(samples[0])]
        L = [min(int(s["input_ids"].shape[0]), self.max_length) for s in good]
        B, T = len(good), max(L, default=0)
        T = -(-T // self.pad_multiple) * self.pad_multiple  # aligned keys suit the fused SDPA kernels
        J = self.ttt_steps
        H3 = good[0]["aux_hidden_states"].shape[1] * good[0]["aux_hidden_states"].shape[2] if good else 0
        k = good[0]["topk_ids"].shape[1] if good else 1
        input_ids = torch.zeros(B, T, dtype=torch.int64)
        aux = torch.empty(B, T, H3, dtype=torch.bfloat16)  # the largest tensor: only its padding is zeroed
        mask = torch.zeros(B, T, dtype=torch.bool)
        top_ids = torch.zeros(B, T, k, dtype=torch.int64)
        top_lp = torch.zeros(B, T, k, dtype=torch.float32)
        for b, (s, n) in enumerate(zip(good, L)):
            input_ids[b, :n] = s["input_ids"][:n]
            aux[b, :n] = s["aux_hidden_states"][:n].reshape(n, -1)
            aux[b, n:] = 0
            mask[b, :n] = s["loss_mask"][:n].bool()
            top_ids[b, :n] = s["topk_ids"][:n]
            top_lp[b, :n] = s["topk_logprobs"][:n]
        # the target's argmax at p is proposable (False in padding)
        in_vocab = (self.t2d_index[top_ids[:, :, 0]] >= 0) & (torch.arange(T)[None] < torch.tensor(L)[:, None])
        keep, full = [], []
        chain = torch.zeros(B, T, dtype=torch.bool)
        for j in range(J):
            kj = torch.zeros(B, T, dtype=torch.bool)
            R = T - 2 - j  # rows 0..R-1 may have a label x[r+2+j] (padding has mask 0)
            if R > 0:
                label = mask[:, 2 + j : 2 + j + R]
                if j == 0:
                    chain[:, :R] = label
                kj[:, :R] = label & in_vocab[:, 1 + j : 1 + j + R]
            keep.append(kj)
            full.append(kj.flatten().nonzero().flatten())  # b*T + r, sample-major
        # chain rows: per sample, the rows with loss at some step >= 1, in a compact layout
        active = torch.stack(keep[1:]).any(0) if J > 1 else torch.zeros(B, T, dtype=torch.bool)
        slot = active.long().cumsum(1) - 1  # [B, T] compact slot of each active row
        Tp = int(active.sum(1).max()) if B else 0
        Tp = -(-Tp // self.pad_multiple) * self.pad_multiple
        chain_rows = torch.zeros(B, Tp, dtype=torch.int64)
        bb, rr = active.nonzero(as_tuple=True)
        chain_rows[bb, slot[bb, rr]] = rr
        out_rows, out_ids, out_q = [], [], []
        flat_ids, flat_lp = top_ids.reshape(B * T, k), top_lp.reshape(B * T, k)
        for j in range(J):
            rj = full[j]
            b, r = rj // T, rj % T
            p = rj + 1 + j  # the target's distribution at position r+1+j of the same sample
            d, q = target_distribution(flat_ids[p], flat_lp[p], self.t2d_index, self.target_temperature)
            out_rows.append(rj if j == 0 else b * Tp + slot[b, r])
            out_ids.append(d)
            out_q.append(q)
        return {
            "input_ids": input_ids,
            "aux_hidden_states": aux,
            "lengths": torch.tensor(L, dtype=torch.int64),
            "chain_rows": chain_rows,
            "rows": out_rows,
            "rows_full": full,
            "target_ids": out_ids,
            "target_q": out_q,
            "chain_starts": chain.flatten(),
            "num_tokens": sum(L) if sample_ids else 0,
            "num_chains": int(chain.sum()),
            "skipped_nonfinite": skipped,
            "skipped_ids": [s.get("sample_id") for s in samples if not self.is_finite(s)] if skipped else [],
            "sample_ids": sample_ids,
        }


def batch_to(batch: dict, device: torch.device | str, non_blocking: bool = True) -> dict:
    """Move the tensors of a collated batch (including the per-step lists) to ``device``."""

    def mv(x):
        if isinstance(x, torch.Tensor):
            return x.to(device, non_blocking=non_blocking)
        if isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
            return [t.to(device, non_blocking=non_blocking) for t in x]
        return x

    return {k: mv(v) for k, v in batch.items()}


# ------------------------------------------------------------------- the unroll
def _step_loss(drafter: Eagle3Drafter, h_rows: torch.Tensor, draft_ids: torch.Tensor, q: torch.Tensor,
               fused: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """One TTT step's loss rows ``h_rows [N, H]`` -> ``(KL [N] float32, drafter argmax [N], logits [N, Vd] or
    None)``; ``fused``: through :func:`eagle3.train.loss.fused_topk_kl`, no logits kept."""
    if fused:
        kl, top = fused_topk_kl(drafter.norm(h_rows), drafter.lm_head.weight, draft_ids, q)
        return kl, top, None
    logits = drafter.compute_logits(h_rows)
    return kl_loss(logits, draft_ids, q), logits.detach().argmax(-1), logits


@dataclass
class TTTOutput:
    """Result of :func:`ttt_forward`.

    Attributes:
        loss: scalar float32, ``sum_j step_weight**j * mean KL_j``.
        step_stats: ``[J, 3]`` float32 sums per step: (KL sum, loss rows, correct).
        accepted: scalar float32, sum over chain starts of accepted draft steps.
        num_chains: number of chain starts (python int).
        accepted_rows: ``[B*T]`` float32, accepted draft steps of the chain at each row
            (0 where no chain starts; :func:`chain_acceptance`).
        logits: per step ``[N_j, Vd]`` logits of the loss rows (only with
            ``return_logits``; for tests).
    """

    loss: torch.Tensor
    step_stats: torch.Tensor
    accepted: torch.Tensor
    num_chains: int
    accepted_rows: torch.Tensor | None = None
    logits: list | None = None


def ttt_forward(
    drafter: Eagle3Drafter,
    batch: dict,
    ttt_steps: int,
    step_weight: float = 0.8,
    return_logits: bool = False,
    chain_chunk: int | None = None,
    fused_loss: bool = False,
    attention: str = "dense",
) -> TTTOutput:
    """Unroll ``ttt_steps`` draft steps over a collated batch (see module docstring).

    Args:
        drafter: the drafter (its ``d2t`` must be the vocabulary the batch was
            collated with).
        batch: from :class:`TTTCollator`, on the drafter's device.
        chain_chunk: steps ``>= 1`` attend per chunk of this many chain rows
            (:class:`eagle3.train.ttt_attention.ChainMask`); None = one dense mask per step.
        attention: ``"dense"`` (a bool mask per step, or ``chain_chunk``) or ``"flex"``
            (:class:`eagle3.train.ttt_attention.FlexChainMask`: one block-sparse FlexAttention kernel per step; training
            on CUDA only).
        fused_loss: the loss and argmax through ``lm_head`` chunk by chunk without keeping
            the logits (:func:`eagle3.train.loss.fused_topk_kl`); ignored with ``return_logits``.

    Returns:
        :class:`TTTOutput`. Runs in the caller's autocast context; the loss is
        float32.
    """
    ids = batch["input_ids"]
    B, T = ids.shape
    dev = ids.device
    aux = batch["aux_hidden_states"]
    if not torch.is_autocast_enabled(dev.type):
        aux = aux.to(drafter.fc.weight.dtype)
    hidden = drafter.fuse(aux)  # [B, T, 3*Ht] -> [B, T, H]
    positions = torch.arange(T, device=dev).expand(B, T)
    chain_rows = batch.get("chain_rows")  # None: every step on every row
    cache = DynamicCache()
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    stats = torch.zeros(ttt_steps, 3, dtype=torch.float32, device=dev)
    hits = []
    all_logits = [] if return_logits else None
    for j in range(ttt_steps):
        if j == 0 or chain_rows is None:
            tokens, pos, mask = step_input_ids(ids, j), positions + j, ttt_attention_mask(T, j, dev)
        else:
            Tp = chain_rows.shape[1]
            if j == 1:  # enter the compact layout of the chain rows
                if Tp == 0:
                    break
                hidden = hidden.gather(1, chain_rows[..., None].expand(B, Tp, hidden.shape[-1]))  # [B, T', H]
                chain_mask = chain_attention(chain_rows, T, attention, chain_chunk)
            src = chain_rows + 1 + j
            tokens = ids.gather(1, src.clamp(max=T - 1)).masked_fill(src >= T, 0)  # x[r+1+j]
            pos = chain_rows + j
            mask = chain_mask.at(j)
        out = drafter(tokens, hidden, pos, attention_mask=mask, past_key_values=cache, return_logits=False)
        hidden = out.hidden_states  # [B, T or T', H]
        rows = batch["rows"][j]
        n = rows.numel()
        kl, top, logits = _step_loss(drafter, hidden.reshape(-1, hidden.shape[-1])[rows], batch["target_ids"][j],
                                     batch["target_q"][j], fused_loss and not return_logits)
        # no row with loss (every argmax outside the draft vocabulary): adds 0 yet keeps the loss on
        # the graph, so the backward of such a micro-batch is a no-op rather than an error
        loss = loss + (step_weight**j) * kl.sum() / max(n, 1)
        with torch.no_grad():
            correct = top == batch["target_ids"][j][:, 0]
            stats[j, 0] = kl.detach().sum()
            stats[j, 1] = n
            stats[j, 2] = correct.sum()
            hit = torch.zeros(B * T, dtype=torch.bool, device=dev)
            hit[batch["rows_full"][j] if chain_rows is not None else rows] = correct  # no loss = rejection
            hits.append(hit)
        if return_logits:
            all_logits.append(logits.detach())
    acc_rows = chain_acceptance(hits, batch["chain_starts"])
    return TTTOutput(loss=loss, step_stats=stats, accepted=acc_rows.sum(), num_chains=int(batch["num_chains"]),
                     accepted_rows=acc_rows, logits=all_logits)


class TTTModel(nn.Module):
    """Wraps a drafter so that one ``forward(batch)`` is the whole TTT unroll
    (what Accelerate prepares: autocast and, with several processes, DDP apply)."""

    def __init__(self, drafter: Eagle3Drafter, ttt_steps: int, step_weight: float, chain_chunk: int | None = None,
                 feature_noise: float = 0.0, attention: str = "dense"):
        super().__init__()
        self.attention = attention  # drafter.ttt_attention
        self.drafter = drafter
        self.ttt_steps = ttt_steps
        self.step_weight = step_weight
        self.chain_chunk = chain_chunk
        self.feature_noise = feature_noise
        self.fused_loss = False  # loop.fused_loss (eagle3.train.loss.fused_topk_kl)
        self.noise_seed: Optional[int] = None  # set per micro-batch by the loop (eagle3.train.noise.noise_seed)

    def forward(self, batch: dict) -> TTTOutput:
        """:func:`ttt_forward` of the wrapped drafter over a collated batch (feature noise only
        while the drafter is in training mode, drawn from a generator seeded by ``noise_seed``)."""
        if self.feature_noise > 0 and self.drafter.training:
            batch = {**batch, "aux_hidden_states": add_feature_noise(batch["aux_hidden_states"], self.feature_noise,
                                                                     self.noise_seed)}
        return ttt_forward(self.drafter, batch, self.ttt_steps, self.step_weight, chain_chunk=self.chain_chunk,
                           fused_loss=self.fused_loss, attention=self.attention)


def summarize(step_stats: torch.Tensor, accepted: float, num_chains: int, step_weight: float) -> dict:
    """Turn summed statistics into metrics: per-step ``loss``/``acc``, weighted
    ``loss``, simulated ``tau`` (plain python floats)."""
    s = step_stats.double().cpu()
    n = s[:, 1].clamp_min(1)
    step_loss = (s[:, 0] / n).tolist()
    step_acc = (s[:, 2] / n).tolist()
    return {
        "loss": float(sum(step_weight**j * l for j, l in enumerate(step_loss))),
        "step_loss": step_loss,
        "step_acc": step_acc,
        "step_rows": [int(x) for x in s[:, 1].tolist()],
        "tau": 1.0 + (float(accepted) / num_chains if num_chains else 0.0),
        "chains": int(num_chains),
    }
