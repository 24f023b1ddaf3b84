"""EAGLE-3 speculative decoding with an in-process transformers target (batch 1).

One *round* = draft, verify, accept, roll back:

1. **Draft.** The proposer first reads the positions verified in the previous round
   (EAGLE-3: the target's aux hidden states at position ``t`` fused by the drafter's
   ``fc``, paired with the embedding of token ``t+1``), then runs ``num_steps`` draft
   forward steps in total; steps after the first feed back the drafter's own output
   hidden state. With ``topk == 1`` the draft is a chain of ``num_steps`` tokens. With
   ``topk > 1`` it is a tree built as SGLang builds it
   (``python/sglang/srt/speculative/eagle_utils.py``: ``select_top_k_tokens``,
   ``organize_draft_results``): the first step keeps the ``topk`` most probable
   children of the root; each later step expands the ``topk`` kept nodes by their
   ``topk`` children each, scores every child by the product of draft probabilities
   along its path, keeps the best ``topk`` for the next step, and finally the best
   ``num_draft_tokens - 1`` candidates of all steps (a set closed under parents) are
   verified.
2. **Verify.** One target forward over ``[root] + draft tokens``: the root is the last
   verified token (not yet in the target's KV cache), so a pass verifies
   ``num_draft_tokens`` tokens as SGLang counts them. Trees use a 4D tree attention
   mask and tree position ids. Forward hooks on three decoder layers give the aux
   hidden states of every verified position for the next round.
3. **Accept.** Temperature 0: the longest draft path whose every token equals the
   target's argmax at its parent, plus the bonus token (the target's argmax after the
   last accepted node). Temperature > 0 (both lossless, the output distribution is the
   target's):

   * chain: drafts are sampled from the drafter's distribution ``q`` and verified by
     standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept
     ``x`` with probability ``min(1, p(x)/q(x))``, on rejection sample from
     ``norm(max(p - q, 0))``; when all are accepted, the bonus is sampled from ``p``.
   * tree: drafts are the deterministic top-k candidates; at each node the children
     are tried in order, each accepted with probability ``p(x) / (mass of p not yet
     rejected)``, a rejected child's token is removed from ``p``; if no child is
     accepted the next token is sampled from what remains (the target-only tree
     sampling SGLang uses, ``tree_speculative_sampling_target_only`` with thresholds
     1). Sequentially trying candidates is exact sampling from ``p``.
4. **Roll back.** Rejected tokens are removed from the target's KV cache (the accepted
   tree path is first moved into contiguous slots), and the drafter's speculative
   KV entries are cropped, so both caches hold exactly the verified prefix.

Counting (SGLang's ``meta_info`` fields): a verify pass yields its accepted drafts
plus one bonus token. ``acceptance length (tau) = tokens emitted by verify passes /
verify passes``. The first generated token comes from the prefill, not from a verify
pass, and is not counted (SGLang's ``completion_tokens`` includes it, which adds
``1 / verify_passes`` to its tau); tokens of the last pass beyond the stop token or
``max_new_tokens`` are not emitted and not counted. ``acceptance rate = accepted
drafts / (verify passes * num_steps)`` (SGLang's ``spec_num_correct_drafts /
spec_num_proposed_drafts``), and the per-pass histogram of accepted drafts is
SGLang's ``spec_correct_drafts_histogram``.

Performance: one host sync per round (two for trees at temperature > 0); the draft
and the acceptance test stay on the device. KV caches are transformers
``DynamicCache`` objects rolled back by cropping.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from eagle3.errors import Eagle3Error


# --------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class SpecSettings:
    """Speculative decoding and sampling settings of one run.

    ``num_steps``/``topk``/``num_draft_tokens`` mean what SGLang's
    ``--speculative-num-steps``/``--speculative-eagle-topk``/
    ``--speculative-num-draft-tokens`` mean. Build with :meth:`make`, which validates.
    """

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 128

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @classmethod
    def make(
        cls,
        num_steps: int,
        topk: int,
        num_draft_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_new_tokens: int = 128,
    ) -> tuple["SpecSettings", Optional[str]]:
        """Validated settings plus an optional note.

        With ``topk == 1`` the number of draft tokens is forced to ``num_steps + 1``
        (as SGLang does); the note says so when the configured value differed.

        Raises:
            Eagle3Error: non-positive steps/topk/max_new_tokens, a tree whose
                ``num_draft_tokens`` is outside ``2 .. 1 + topk + (num_steps-1)*topk**2``
                (the candidates SGLang's tree building can offer), or top_p outside (0, 1].
        """
        if num_steps < 1 or topk < 1:
            raise Eagle3Error(
                f"speculative.num_steps ({num_steps}) and speculative.topk ({topk}) must be >= 1"
            )
        if max_new_tokens < 1:
            raise Eagle3Error(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not 0.0 < top_p <= 1.0:
            raise Eagle3Error(f"top_p must be in (0, 1], got {top_p}")
        note = None
        if topk == 1:
            if num_draft_tokens != num_steps + 1:
                note = (
                    f"speculative.num_draft_tokens={num_draft_tokens} ignored: a chain (topk=1) "
                    f"verifies num_steps+1 = {num_steps + 1} tokens per pass (as SGLang forces)"
                )
            num_draft_tokens = num_steps + 1
        else:
            most = 1 + topk + (num_steps - 1) * topk * topk
            if not 2 <= num_draft_tokens <= most:
                raise Eagle3Error(
                    f"speculative.num_draft_tokens={num_draft_tokens} is impossible with "
                    f"num_steps={num_steps}, topk={topk}; use a value in 2..{most}"
                )
        return (
            cls(num_steps, topk, num_draft_tokens, float(temperature), float(top_p), int(max_new_tokens)),
            note,
        )


# --------------------------------------------------------------------------- results
@dataclass
class GenerationResult:
    """One prompt's generation.

    ``tokens``: generated target token ids (first one from the prefill), ending at the
    first stop token (included) or at ``max_new_tokens``. ``verify_passes``,
    ``accepted_drafts``: counts over the verify passes (accepted drafts counted as the
    verifier decided, before truncation at the end). ``accept_counts[i]``: drafts
    accepted by pass i. ``emitted``: tokens emitted by verify passes (bonus included,
    truncated at the end) = ``len(tokens) - 1``. ``seconds``: wall time of the whole
    generation, device-synchronised; ``prefill_seconds``: of which until the first
    token was known.
    """

    tokens: list[int]
    verify_passes: int = 0
    accepted_drafts: int = 0
    emitted: int = 0
    accept_counts: list[int] = field(default_factory=list)
    seconds: float = 0.0
    prefill_seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """tau = emitted tokens / verify passes (``nan`` without a pass)."""
        return self.emitted / self.verify_passes if self.verify_passes else float("nan")


# --------------------------------------------------------------------------- helpers
def synchronize(device: torch.device | str) -> None:
    """Wait for queued device work (CUDA); a no-op on CPU. Used around timings."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def truncate_cache(cache, length: int) -> None:
    """Crop a transformers ``Cache`` to its first ``length`` positions (no-op if shorter).

    Uses ``Cache.crop`` with a negative count (transformers >= 5.x semantics).
    """
    current = cache.get_seq_length()
    if current > length:
        cache.crop(-(current - length))


def _compact_cache(cache, start: int, keep: torch.Tensor, contiguous: bool) -> None:
    """Keep cache slots ``start + keep`` (sorted relative indices) at ``start ..``, drop the rest.

    For a tree the accepted path is scattered over the verify slots; its entries are
    moved in place to the first ``len(keep)`` slots after ``start``, then cropped.
    """
    n = int(keep.numel())
    if not contiguous:
        src = start + keep
        for layer in cache.layers:
            layer.keys[..., start : start + n, :] = layer.keys[..., src, :]
            layer.values[..., start : start + n, :] = layer.values[..., src, :]
    truncate_cache(cache, start + n)


def target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Next-token distribution the target samples from.

    Args:
        logits: ``[..., V]`` any float dtype.
        temperature: > 0.
        top_p: nucleus mass in (0, 1]; 1 keeps the full distribution.

    Returns:
        ``[..., V]`` float32 probabilities (tokens outside the nucleus are 0),
        each row summing to 1. Baseline and speculative decoding both sample from it.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep a token while the mass before it is < top_p (the top token always kept)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _stop_index(tokens: Sequence[int], stop_ids: frozenset[int], room: int) -> int:
    """How many of ``tokens`` to emit: up to ``room``, through the first stop token."""
    for i, t in enumerate(tokens[:room]):
        if t in stop_ids:
            return i + 1
    return min(len(tokens), room)


# --------------------------------------------------------------------------- target
def _decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder-layer list of a transformers causal LM (``model.model.layers``)."""
    base = getattr(model, "model", None)
    for candidate in (base, getattr(base, "language_model", None), getattr(model, "language_model", None)):
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise Eagle3Error(
        f"cannot find the decoder layers of {type(model).__name__} (expected model.model.layers); "
        "use a transformers decoder-only causal LM as the target"
    )


class TargetRunner:
    """The target as the verifier runs it: forward with a KV cache, aux hidden states by hooks.

    Aux id ``k`` (HF ``output_hidden_states`` convention, see :mod:`eagle3.target.layers`) is
    the residual stream entering decoder layer ``k``, read here as the output of layer
    ``k - 1`` by a forward hook (``k = L`` is the last layer's output before the final
    norm). Only these three layers are hooked; nothing else is retained.

    Args:
        model: a transformers causal LM (eval mode, any device/dtype).
        aux_layer_ids: HF-convention ids in ``1..L``, or ``None`` for no capture.
    """

    def __init__(self, model, aux_layer_ids: Optional[Sequence[int]] = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.config.vocab_size)
        self.attn_implementation = getattr(model.config, "_attn_implementation", "sdpa")
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else None
        self._captured: dict[int, torch.Tensor] = {}
        self.capture = self.aux_layer_ids is not None
        self._handles = []
        if self.aux_layer_ids is not None:
            layers = _decoder_layers(model)
            for k in self.aux_layer_ids:
                if not 1 <= k <= len(layers):
                    raise Eagle3Error(
                        f"aux layer id {k} is outside the target's {len(layers)} layers; "
                        "the drafter export does not belong to this target"
                    )
                self._handles.append(layers[k - 1].register_forward_hook(self._hook(k)))

    def _hook(self, k: int):
        def fn(module, args, output):
            if self.capture:
                self._captured[k] = output[0] if isinstance(output, tuple) else output

        return fn

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def tree_mask(self, visible: torch.Tensor) -> torch.Tensor:
        """``[n, S]`` bool (True = attend) -> the 4D mask this attention implementation reads."""
        mask = visible[None, None]
        if self.attn_implementation == "eager":
            dtype = next(self.model.parameters()).dtype
            zero = torch.zeros((), dtype=dtype, device=mask.device)
            return torch.where(mask, zero, torch.finfo(dtype).min)
        if self.attn_implementation == "sdpa":
            return mask
        raise Eagle3Error(
            f"tree verification needs a custom attention mask, which attn_implementation="
            f"'{self.attn_implementation}' does not take; use engine.attn_implementation=sdpa or eager"
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache,
        attention_mask: Optional[torch.Tensor] = None,
        last_only: bool = False,
        capture: bool = True,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run the target on new tokens, appending them to ``cache``.

        Args:
            input_ids: ``[1, n]`` int64 target ids.
            position_ids: ``[1, n]`` int64.
            cache: the sequence's ``DynamicCache``.
            attention_mask: ``None`` (causal) or a 4D mask from :meth:`tree_mask`.
            last_only: compute logits of the last position only (prefill).
            capture: return aux hidden states (when the runner has aux ids).

        Returns:
            ``(logits [n or 1, V] float, aux [n, 3*H] or None)`` with aux in the
            model dtype, concatenated in ``aux_layer_ids`` order.
        """
        self.capture = capture and self.aux_layer_ids is not None
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        aux = None
        if self.capture:
            aux = torch.cat([self._captured[k][0] for k in self.aux_layer_ids], dim=-1)  # [n, 3H]
            self._captured.clear()
        return out.logits[0], aux


# --------------------------------------------------------------------------- proposers
class DraftProposer(abc.ABC):
    """What drafts tokens for :class:`SpeculativeDecoder` (EAGLE-3 drafter, or test oracles).

    A proposer keeps its own per-sequence state (e.g. a KV cache). Per round the
    decoder calls :meth:`begin` once, :meth:`step` ``num_steps - 1`` times, then
    :meth:`end_round`. Logits are over the proposer's *draft vocabulary* ``Vd``;
    :attr:`vocab_target_ids` maps a draft id to a target id.
    """

    #: HF-convention aux layer ids the proposer reads from the target (None = none).
    aux_layer_ids: Optional[list[int]] = None
    #: ``[Vd]`` int64: the target id of every draft id (identity for a full vocabulary).
    vocab_target_ids: torch.Tensor

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget the current sequence (a new prompt starts)."""

    @abc.abstractmethod
    def begin(self, input_ids: torch.Tensor, aux: Optional[torch.Tensor], start: int) -> torch.Tensor:
        """Read newly verified positions and draft the first step.

        Args:
            input_ids: ``[m]`` int64 target ids of tokens ``start+1 .. start+m`` (the
                token *after* each position: EAGLE-3 pairs features at ``t`` with
                token ``t+1``; the last one is the round's root).
            aux: ``[m, 3*Ht]`` target aux hidden states at positions
                ``start .. start+m-1``, or None when the proposer reads none.
            start: first position; equals the number of positions read so far.

        Returns:
            ``[Vd]`` float logits for the token after the root.
        """

    @abc.abstractmethod
    def step(self, input_ids: torch.Tensor, parents: torch.Tensor, position: int) -> torch.Tensor:
        """One further draft step over ``w`` tree nodes of the same depth.

        Args:
            input_ids: ``[w]`` int64 target ids of the nodes (drafted last step).
            parents: ``[w]`` int64 index of each node's parent among the rows returned
                by the previous call (``begin`` returns one row).
            position: drafter position id of the nodes (``start + m - 1 + depth``).

        Returns:
            ``[w, Vd]`` float logits for each node's next token.
        """

    @abc.abstractmethod
    def end_round(self) -> None:
        """Drop the state of this round's draft steps (keep what :meth:`begin` read)."""

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (``draft_id + d2t[draft_id]``)."""
        return self.vocab_target_ids[draft_ids]


class Eagle3Proposer(DraftProposer):
    """The EAGLE-3 drafter as a proposer.

    First step of a round: ``drafter(input_ids = tokens t+1, hidden_states =
    drafter.fuse(aux_t), positions t)`` over the newly verified positions, appended to
    the drafter's KV cache. Later steps feed the drafter's own pre-norm output hidden
    state of the parent node at position ``parent + 1``; tree steps attend to the
    verified prefix and to their own ancestors only (4D bool mask, True = attend).

    Args:
        drafter: an ``eagle3.train.drafter.Eagle3Drafter`` (``fuse``, ``forward``, ``d2t``).
        aux_layer_ids: HF-convention ids the drafter was trained on (from its export).
    """

    def __init__(self, drafter, aux_layer_ids: Sequence[int]):
        self.drafter = drafter
        self.aux_layer_ids = list(aux_layer_ids)
        self.vocab_target_ids = drafter.draft_ids()  # [Vd] int64: i + d2t[i]
        self.dtype = drafter.fc.weight.dtype
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.committed = 0  # positions read with target features
        self._hidden: Optional[torch.Tensor] = None  # [rows, H] outputs of the last call
        self._ancestors: Optional[torch.Tensor] = None  # [rows, draft slots] bool

    def begin(self, input_ids, aux, start):
        if start != self.committed:
            raise RuntimeError(f"drafter state holds {self.committed} positions, round starts at {start}")
        m = input_ids.numel()
        hidden = self.drafter.fuse(aux.to(self.dtype)[None])  # [1, m, 3Ht] -> [1, m, H]
        pos = torch.arange(start, start + m, device=input_ids.device)[None]
        out = self.drafter(
            input_ids[None], hidden, pos, attention_mask=None, past_key_values=self.cache, use_cache=True,
            return_logits=False,
        )
        self.cache = out.past_key_values
        self.committed = start + m
        self._hidden = out.hidden_states[0, -1:]  # [1, H]
        self._ancestors = None
        return self.drafter.compute_logits(self._hidden)[0]  # [Vd]: only the root's row

    def step(self, input_ids, parents, position):
        w = input_ids.numel()
        hidden = self._hidden[parents]  # [w, H]
        mask = None
        if w > 1 or (self._ancestors is not None and self._ancestors.shape[0] > 1):
            dev = input_ids.device
            prev = (
                self._ancestors[parents]
                if self._ancestors is not None
                else torch.zeros(w, 0, dtype=torch.bool, device=dev)
            )
            anc = torch.cat([prev, torch.eye(w, dtype=torch.bool, device=dev)], dim=1)  # [w, slots]
            self._ancestors = anc
            prefix = torch.ones(w, self.committed, dtype=torch.bool, device=dev)
            mask = torch.cat([prefix, anc], dim=1)[None, None]  # [1, 1, w, committed + slots]
        pos = torch.full((1, w), position, dtype=torch.long, device=input_ids.device)
        out = self.drafter(
            input_ids[None], hidden[None].to(self.dtype), pos,
            attention_mask=mask, past_key_values=self.cache, use_cache=True,
        )
        self.cache = out.past_key_values
        self._hidden = out.hidden_states[0]  # [w, H]
        return out.logits[0]

    def end_round(self) -> None:
        truncate_cache(self.cache, self.committed)
        self._ancestors = None


# --------------------------------------------------------------------------- draft tree
@dataclass
class DraftTree:
    """A round's draft, root included.

    ``tokens [N]`` int64 target ids (index 0 = root, the last verified token);
    ``parents [N]`` int64 (``parents[0] = -1``; ``parents[j] < j``); ``depth [N]``
    int64 (root 0). ``draft_probs``: for chains sampled at temperature > 0,
    ``[num_steps, Vd]`` float32 draft distributions each draft token was sampled from.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    draft_probs: Optional[torch.Tensor] = None


def build_draft(
    proposer: DraftProposer,
    root: torch.Tensor,
    first_logits: torch.Tensor,
    last_position: int,
    settings: SpecSettings,
    generator: Optional[torch.Generator] = None,
) -> DraftTree:
    """Run the remaining ``num_steps - 1`` draft steps and return the draft to verify.

    Args:
        proposer: after :meth:`DraftProposer.begin` (which produced ``first_logits``).
        root: ``[1]`` int64 target id of the last verified token.
        first_logits: ``[Vd]`` draft logits for the root's children.
        last_position: drafter position of the root's features (``start + m - 1``).
        settings: steps/topk/draft tokens; temperature > 0 samples chain drafts.
        generator: for sampled chain drafts.

    Chains (topk=1): argmax at temperature 0, else sampled from
    ``softmax(logits / T)``. Trees: SGLang's top-k expansion and selection (module
    docstring); scores are sums of draft log-probabilities (the log of SGLang's
    products), and ties keep the earlier candidate so the selection is closed under
    parents.
    """
    k, dev = settings.num_steps, root.device
    if settings.is_chain:
        logits, ids, probs = first_logits[None], [], []
        for i in range(k):
            if i:
                logits = proposer.step(proposer.to_target(ids[-1]), torch.zeros(1, dtype=torch.long, device=dev),
                                       last_position + i)
            if settings.greedy:
                ids.append(logits.argmax(-1))
            else:
                q = torch.softmax(logits.float() / settings.temperature, dim=-1)  # [1, Vd]
                ids.append(torch.multinomial(q, 1, generator=generator)[:, 0])
                probs.append(q[0])
        tokens = torch.cat([root, proposer.to_target(torch.cat(ids))])
        parents = torch.arange(-1, k, device=dev)
        depth = torch.arange(0, k + 1, device=dev)
        return DraftTree(tokens, parents, depth, torch.stack(probs) if probs else None)

    topk = settings.topk
    logp, ids = torch.log_softmax(first_logits.float(), -1).topk(topk)  # [topk]
    pool_scores, pool_ids = [logp], [ids]
    pool_parents = [torch.full((topk,), -1, dtype=torch.long, device=dev)]  # pool index, -1 = root
    pool_depth = [torch.ones(topk, dtype=torch.long, device=dev)]
    cur_ids, cur_scores = ids, logp
    cur_pool = torch.arange(topk, device=dev)
    cur_parents = torch.zeros(topk, dtype=torch.long, device=dev)  # rows of begin's output
    base = topk
    for i in range(1, k):
        logits = proposer.step(proposer.to_target(cur_ids), cur_parents, last_position + i)  # [topk, Vd]
        lp, child = torch.log_softmax(logits.float(), -1).topk(topk, dim=-1)  # [topk, topk]
        scores = (cur_scores[:, None] + lp).flatten()  # [topk*topk]
        child = child.flatten()
        pool_scores.append(scores)
        pool_ids.append(child)
        pool_parents.append(cur_pool.repeat_interleave(topk))
        pool_depth.append(torch.full((topk * topk,), i + 1, dtype=torch.long, device=dev))
        sel = scores.topk(topk).indices
        cur_ids, cur_scores = child[sel], scores[sel]
        cur_pool = base + sel
        cur_parents = sel // topk
        base += topk * topk
    scores = torch.cat(pool_scores)
    order = torch.sort(-scores, stable=True).indices[: settings.num_draft_tokens - 1]
    chosen = order.sort().values  # pool indices, parents before children
    tree_index = torch.full((scores.numel() + 1,), -1, dtype=torch.long, device=dev)  # pool idx -> tree idx
    tree_index[chosen] = torch.arange(1, chosen.numel() + 1, device=dev)
    tree_index[-1] = 0  # pool parent -1 (the root) -> tree index 0
    parents = torch.cat([torch.tensor([-1], device=dev), tree_index[torch.cat(pool_parents)[chosen]]])
    tokens = torch.cat([root, proposer.to_target(torch.cat(pool_ids)[chosen])])
    depth = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.cat(pool_depth)[chosen]])
    return DraftTree(tokens, parents, depth)


def tree_ancestors(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[N, N]`` bool: ``[i, j]`` True iff node j is node i or one of its ancestors.

    ``parents[0] = -1`` (root); ``max_depth`` bounds the depth of any node.
    """
    n = parents.numel()
    rows = torch.arange(n, device=parents.device)
    anc = torch.eye(n, dtype=torch.bool, device=parents.device)
    cur = parents.clone()
    for _ in range(max_depth):  # integer indexing only: no host sync
        valid = cur >= 0
        col = cur.clamp(min=0)
        anc[rows, col] = anc[rows, col] | valid
        cur = torch.where(valid, parents[col], cur)
    return anc


# --------------------------------------------------------------------------- acceptance
def accept_greedy(tree: DraftTree, target_logits: torch.Tensor, max_depth: int) -> tuple[list[int], int]:
    """Temperature-0 acceptance (one host sync).

    Args:
        tree: the verified draft (``N`` nodes).
        target_logits: ``[N, V]`` target logits at each node.
        max_depth: ``num_steps``.

    Returns:
        ``(path, tokens)``: tree indices of the accepted path (root first, parents
        before children) and the tokens it yields: the accepted drafts, then the bonus
        token (target argmax at the path's end).
    """
    best = target_logits.argmax(-1)  # [N]
    parent = tree.parents.clamp(min=0)
    ok = tree.tokens == best[parent]
    ok[0] = True
    for _ in range(max_depth):
        ok = ok & ok[parent]
    flags, parents, best_cpu, tokens = torch.stack([ok.long(), tree.parents, best, tree.tokens]).tolist()
    # follow accepted children from the root (the first one if two siblings share a token)
    path, node = [0], 0
    for j in range(1, len(flags)):
        if flags[j] and parents[j] == node:
            path.append(j)
            node = j
    return path, [tokens[j] for j in path[1:]] + [best_cpu[node]]


def accept_chain_sampling(
    tree: DraftTree,
    p: torch.Tensor,
    vocab_target_ids: torch.Tensor,
    generator: Optional[torch.Generator] = None,
) -> tuple[list[int], int]:
    """Standard speculative sampling on a chain (one host sync).

    Args:
        tree: a chain with ``draft_probs [k, Vd]`` (drafts were sampled from them).
        p: ``[k+1, V]`` float32 target probabilities at root and each draft node.
        vocab_target_ids: ``[Vd]`` target id of each draft id.
        generator: the sequence's random generator.

    Returns:
        ``(path, tokens)``: accepted path (``[0 .. a]``) and the tokens it yields: the
        accepted drafts, then the token sampled after them (from the residual
        ``norm(max(p - q, 0))`` at the first rejection, or from ``p`` after the last
        draft). The result is distributed exactly as ``p``.
    """
    k = tree.tokens.numel() - 1
    q = torch.zeros(k, p.shape[1], dtype=torch.float32, device=p.device)
    q.index_add_(1, vocab_target_ids, tree.draft_probs.float())  # [k, V] in target ids
    drafts = tree.tokens[1:]
    rows = torch.arange(k, device=p.device)
    ratio = p[rows, drafts] / q[rows, drafts]
    u = torch.rand(k, device=p.device, generator=generator)
    accepted = u < ratio  # min(1, ratio) is implied
    residual = torch.clamp(p[:k] - q, min=0.0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p[:k])
    dist = torch.cat([residual, p[k:]])  # [k+1, V]
    samples = torch.multinomial(dist, 1, generator=generator)[:, 0]  # [k+1]
    flags, samples, tokens = torch.stack(
        [torch.cat([accepted.long(), accepted.new_zeros(1).long()]), samples, tree.tokens]
    ).tolist()
    a = 0
    while a < k and flags[a]:
        a += 1
    return list(range(a + 1)), tokens[1 : a + 1] + [samples[a]]


def accept_tree_sampling(
    tree: DraftTree,
    p: torch.Tensor,
    generator: Optional[torch.Generator] = None,
) -> tuple[list[int], int]:
    """Target-only sampling over a tree of deterministic candidates (two host syncs).

    At each node the children are tried in tree order; child ``x`` is accepted with
    probability ``p(x) / (1 - mass of rejected siblings)``; a rejected child's token is
    removed; with no child accepted the next token is sampled from the remaining
    ``p``. This is exact sampling from ``p`` (``[N, V]`` float32 at each node).

    Returns:
        ``(path, tokens)``: accepted path and the accepted drafts plus the next token.
    """
    n = tree.tokens.numel()
    parent = tree.parents.clamp(min=0)
    child_p = p[parent, tree.tokens]  # [N]: p at parent of each node's token
    u = torch.rand(n, device=p.device, generator=generator)
    tokens, parents, child_p, u = (
        tree.tokens.tolist(), tree.parents.tolist(), child_p.tolist(), u.tolist()
    )
    children: dict[int, list[int]] = {}
    for j in range(1, n):
        children.setdefault(parents[j], []).append(j)
    path, node, rejected = [0], 0, []
    while True:
        removed, moved = 0.0, False
        rejected = []
        for c in children.get(node, []):
            remaining = 1.0 - removed
            if remaining > 0 and u[c] * remaining < child_p[c]:
                path.append(c)
                node, moved = c, True
                break
            removed += child_p[c]
            rejected.append(tokens[c])
        if not moved:
            break
    dist = p[node].clone()
    if rejected:
        dist[torch.tensor(rejected, device=p.device)] = 0.0
        # all mass rejected can only happen numerically; fall back to p then
        dist = torch.where(dist.sum() > 0, dist, p[node])
    nxt = int(torch.multinomial(dist, 1, generator=generator))
    return path, [tokens[j] for j in path[1:]] + [nxt]


# --------------------------------------------------------------------------- decoders
def _sample(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.inference_mode()
def target_generate(
    runner: TargetRunner,
    prompt_ids: Sequence[int],
    settings: SpecSettings,
    stop_ids: Sequence[int] = (),
    generator: Optional[torch.Generator] = None,
) -> GenerationResult:
    """The target's own decoding (the baseline): prefill, then one token per forward.

    Same prefill and KV cache as :class:`SpeculativeDecoder`; greedy at temperature 0,
    else sampled from :func:`target_probs`. Returns tokens and synchronised seconds
    (no verify passes).
    """
    stop = frozenset(int(s) for s in stop_ids)
    dev = runner.device
    synchronize(dev)
    t0 = time.perf_counter()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    cache = runner.new_cache()
    pos = torch.arange(ids.shape[1], device=dev)[None]
    logits, _ = runner.forward(ids, pos, cache, last_only=True, capture=False)
    out: list[int] = []
    n = ids.shape[1]
    prefill = None
    while True:
        if settings.greedy:
            tok = logits[-1:].argmax(-1)
        else:
            tok = _sample(target_probs(logits[-1:], settings.temperature, settings.top_p), generator)
        t = int(tok)  # host sync
        if prefill is None:
            prefill = time.perf_counter() - t0
        out.append(t)
        if t in stop or len(out) >= settings.max_new_tokens:
            break
        logits, _ = runner.forward(tok[None], torch.tensor([[n]], device=dev), cache, capture=False)
        n += 1
    synchronize(dev)
    return GenerationResult(tokens=out, seconds=time.perf_counter() - t0, prefill_seconds=prefill)


class SpeculativeDecoder:
    """EAGLE-3 speculative decoding at batch 1 (see the module docstring).

    Args:
        runner: the target (its ``aux_layer_ids`` must equal the proposer's).
        proposer: the drafter (or a test proposer).
        settings: from :meth:`SpecSettings.make`.
        stop_ids: generation ends after any of these tokens (EOS, end of turn).
    """

    def __init__(self, runner: TargetRunner, proposer: DraftProposer, settings: SpecSettings,
                 stop_ids: Sequence[int] = ()):
        if proposer.aux_layer_ids != runner.aux_layer_ids:
            raise Eagle3Error(
                f"the target runner captures aux layers {runner.aux_layer_ids} but the drafter reads "
                f"{proposer.aux_layer_ids}; build the TargetRunner with the drafter's aux ids"
            )
        self.runner, self.proposer, self.settings = runner, proposer, settings
        self.stop = frozenset(int(s) for s in stop_ids)

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], generator: Optional[torch.Generator] = None) -> GenerationResult:
        """Generate for one prompt (``[P]`` target ids, chat-rendered) -> :class:`GenerationResult`."""
        s, runner, prop = self.settings, self.runner, self.proposer
        dev = runner.device
        synchronize(dev)
        t0 = time.perf_counter()
        prop.reset()
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
        plen = ids.shape[1]
        cache = runner.new_cache()
        logits, aux = runner.forward(ids, torch.arange(plen, device=dev)[None], cache, last_only=True)
        if s.greedy:
            root = logits[-1:].argmax(-1)  # [1]
        else:
            root = _sample(target_probs(logits[-1:], s.temperature, s.top_p), generator)
        first = int(root)
        res = GenerationResult(tokens=[first])
        synchronize(dev)
        res.prefill_seconds = time.perf_counter() - t0
        if first in self.stop or s.max_new_tokens <= 1:
            res.seconds = res.prefill_seconds
            return res
        # drafter reads positions 0..P-1: tokens 1..P (the last is the root), features 0..P-1
        new_ids = torch.cat([ids[0, 1:], root])
        start = 0
        length = plen  # target KV length = positions verified and in the cache
        while True:
            first_logits = prop.begin(new_ids, aux, start)
            tree = build_draft(prop, root, first_logits, start + new_ids.numel() - 1, s, generator)
            prop.end_round()
            n = tree.tokens.numel()
            pos = (length + tree.depth)[None]
            if s.is_chain:
                mask = None
            else:
                visible = torch.cat(
                    [torch.ones(n, length, dtype=torch.bool, device=dev), tree_ancestors(tree.parents, s.num_steps)],
                    dim=1,
                )
                mask = runner.tree_mask(visible)
            logits, aux_all = runner.forward(tree.tokens[None], pos, cache, attention_mask=mask)
            if s.greedy:
                path, proposed = accept_greedy(tree, logits, s.num_steps)
            else:
                p = target_probs(logits, s.temperature, s.top_p)
                if s.is_chain:
                    path, proposed = accept_chain_sampling(tree, p, prop.vocab_target_ids, generator)
                else:
                    path, proposed = accept_tree_sampling(tree, p, generator)
            a = len(path) - 1
            res.verify_passes += 1
            res.accepted_drafts += a
            res.accept_counts.append(a)
            room = s.max_new_tokens - len(res.tokens)
            take = _stop_index(proposed, self.stop, room)
            res.tokens.extend(proposed[:take])
            res.emitted += take
            if take < len(proposed) or proposed[take - 1] in self.stop or len(res.tokens) >= s.max_new_tokens:
                break
            # roll back: keep root + accepted path in the target cache (and their aux states)
            if path == list(range(a + 1)):  # a prefix of the verify slots (always for chains)
                truncate_cache(cache, length + a + 1)
                aux = aux_all[: a + 1] if aux_all is not None else None
            else:
                path_t = torch.tensor(path, device=dev)
                _compact_cache(cache, length, path_t, contiguous=False)
                aux = aux_all[path_t] if aux_all is not None else None
            start, length = length, length + a + 1
            new_ids = torch.tensor(proposed, dtype=torch.long, device=dev)
            root = new_ids[-1:]
        synchronize(dev)
        res.seconds = time.perf_counter() - t0
        return res
