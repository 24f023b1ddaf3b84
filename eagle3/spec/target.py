"""The target as the verifier runs it, and the KV-cache bookkeeping of the rounds.

:class:`TargetRunner` runs the target's forward with a transformers ``DynamicCache``,
reads the aux hidden states of every new position by forward hooks and builds the 4D
masks of tree verification; :func:`truncate_cache` and :func:`_compact_cache` roll a
cache back to the verified prefix (see step 4 of a round in :mod:`eagle3.spec.decoder`);
:func:`synchronize` waits for the device around timings.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from eagle3.errors import Eagle3Error
from eagle3.runtime.mask import explicit_mask  # noqa: F401  (part of this module's API)


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

    Raises:
        Eagle3Error: an aux id outside ``1..L``, or a model without ``model.model.layers``.
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
        """An empty transformers ``DynamicCache`` for one sequence of this target."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def reserve(self, cache, length: int) -> None:
        """Declare that ``cache`` will hold up to ``length`` positions (a dynamic cache
        grows as needed; a static one raises when it is too short)."""

    def tree_mask(self, visible: torch.Tensor) -> torch.Tensor:
        """``[n, S]`` bool (True = attend) -> the 4D mask this attention implementation reads.

        ``sdpa`` reads the bool mask ``[1, 1, n, S]`` as is; ``eager`` reads an additive
        mask in the model dtype (0 = attend, the dtype's minimum = masked).

        Raises:
            Eagle3Error: another attention implementation (it takes no custom mask).
        """
        return explicit_mask(visible[None, None], self.attn_implementation, next(self.model.parameters()).dtype,
                             "tree verification")

    # --- the four calls of a round (a static-cache runner overrides them) -----------------
    def prefill(self, input_ids: torch.Tensor, cache, capture: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The prompt's forward: ``input_ids [1, P]`` -> ``(logits [1, V] of the last
        position, aux [P, 3*H] or None)``; ``cache`` then holds positions ``0 .. P-1``."""
        pos = torch.arange(input_ids.shape[1], device=self.device)[None]
        return self.forward(input_ids, pos, cache, last_only=True, capture=capture)

    def decode(self, token: torch.Tensor, position: int, cache) -> torch.Tensor:
        """One plain decode step (the baseline): ``token [1]`` at ``position`` -> logits ``[1, V]``."""
        logits, _ = self.forward(token[None], torch.tensor([[position]], device=self.device), cache, capture=False)
        return logits

    def verify(self, tokens: torch.Tensor, depth: torch.Tensor, ancestors: Optional[torch.Tensor], cache,
               length: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The verify pass over a draft of ``N`` nodes appended after ``length`` verified positions.

        Args:
            tokens: ``[N]`` int64 target ids, root first.
            depth: ``[N]`` int64 node depths (positions are ``length + depth``).
            ancestors: ``[N, N]`` bool (:func:`eagle3.spec.tree.tree_ancestors`) for a tree,
                None for a chain (causal).
            cache: holds ``length`` positions; the nodes are appended.
            length: verified positions in ``cache`` (the root's position).

        Returns:
            ``(logits [N, V], aux [N, 3*H] or None)``.
        """
        mask = None
        if ancestors is not None:
            n = tokens.numel()
            visible = torch.cat([torch.ones(n, length, dtype=torch.bool, device=self.device), ancestors], dim=1)
            mask = self.tree_mask(visible)
        return self.forward(tokens[None], (length + depth)[None], cache, attention_mask=mask)

    def rollback(self, cache, length: int, path: Sequence[int]) -> Optional[torch.Tensor]:
        """Keep the root and the accepted path of the last verify pass (``path``: tree indices,
        root first) at positions ``length ..``; drop the other nodes.

        Returns:
            ``[len(path)]`` int64 device tensor of ``path`` when the path was not a prefix of
            the verify slots (a tree: its nodes were moved), else None (slots already in place).
        """
        if list(path) == list(range(len(path))):
            truncate_cache(cache, length + len(path))
            return None
        path_t = torch.tensor(list(path), device=self.device)
        _compact_cache(cache, length, path_t, contiguous=False)
        return path_t

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
