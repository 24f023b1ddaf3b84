"""The train stage's data: the feature datasets, their fit to the target, and the global batch plan.

:func:`open_datasets` opens the training and validation splits of the extract stage's
features and checks that they come from the configured target. Batches are
length-bucketed up to ``max_tokens`` padded tokens and their order is a pure function of
``(seed, epoch)`` (:func:`length_bucketed_batches`); :class:`BatchPlan` cuts each epoch's
list to whole optimizer steps and deals micro-batch ``i`` to process ``i % world``, so the
samples of optimizer step ``k`` do not depend on how the global batch is split between
processes and gradient accumulation. :func:`make_loader` turns a list of batches into a
``DataLoader``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from eagle3.errors import Eagle3Error
from eagle3.features import LAYOUT_RETOKENIZED, LAYOUT_TARGET_IDS, FeatureDataset, sample_layout

log = logging.getLogger("eagle3")


# ------------------------------------------------------------------- datasets
def check_features_match_target(metadata: dict, target: Any, dirs: list[Path]) -> list[int]:
    """The features must come from the configured target; returns their aux ids.

    Args:
        metadata: the ``metadata`` block of the first features manifest (its ``target``
            record and ``aux_layer_ids``, as the extract stage writes them).
        target: a ``TargetInfo`` (``name``, ``content_hash``, ``hidden_size``,
            ``vocab_size``, ``aux_layer_ids``).
        dirs: the features folders (the first one is named in errors).

    Raises:
        Eagle3Error: content hash, hidden size, vocabulary or aux layer ids differ.
    """
    t = metadata.get("target") or {}
    name = dirs[0]
    if t.get("content_hash") and getattr(target, "content_hash", None) and t["content_hash"] != target.content_hash:
        mine = getattr(target, "dtype", None)
        if t.get("dtype") and mine and t["dtype"] != mine:  # e.g. the float32 build of the CPU preset
            raise Eagle3Error(
                f"features in {name} were extracted from the {t['dtype']} build of the target, but model.dtype is "
                f"{mine}; pass model.dtype={t['dtype']}"
            )
        from eagle3.target.build_record import hash_mismatch_advice

        raise Eagle3Error(
            f"features in {name} were extracted from target weights {t['content_hash']} but model={target.name} "
            f"resolves to {target.content_hash}; train with the model the features came from. "
            + hash_mismatch_advice(t.get("build"), getattr(target, "build", None), getattr(target, "path", None))
        )
    for key in ("hidden_size", "vocab_size"):
        if t.get(key) is not None and int(t[key]) != int(getattr(target, key)):
            raise Eagle3Error(f"features in {name} have target {key}={t[key]}, model={target.name} has {getattr(target, key)}")
    aux = metadata.get("aux_layer_ids")
    if aux is None:
        raise Eagle3Error(f"the manifest of {name} does not record aux_layer_ids; re-run extract.py")
    if list(aux) != list(target.aux_layer_ids):
        raise Eagle3Error(
            f"features in {name} hold aux layers {list(aux)} but model.aux_layer_ids resolves to "
            f"{list(target.aux_layer_ids)}; set model.aux_layer_ids={list(aux)} or re-extract"
        )
    return list(aux)


def check_sample_layouts(manifests: list[dict], dirs: list[Path]) -> list[str]:
    """The sample layout of every features folder; refuses to train on a mix of the two
    layouts of regenerated replies.

    Folders written before manifests recorded ``metadata.sample_layout`` hold
    regenerated replies decoded and tokenized again (``retokenized_replies``); newer
    ones hold the target's own ids (``target_ids``); see :mod:`eagle3.features.format`.
    Either trains on its own (an old folder with a warning), and either may be mixed
    with dataset replies (``template_text``), but not with each other, since the same
    reply would appear in two segmentations.

    Raises:
        Eagle3Error: ``retokenized_replies`` and ``target_ids`` folders mixed (names one of each).
    """
    layouts = [sample_layout(m["metadata"]) for m in manifests]
    old = [d for d, x in zip(dirs, layouts) if x == LAYOUT_RETOKENIZED]
    new = [d for d, x in zip(dirs, layouts) if x == LAYOUT_TARGET_IDS]
    if old and new:
        raise Eagle3Error(
            f"features in {old[0]} hold the target's replies tokenized again from text (extracted before samples "
            f"kept the target's own ids) and {new[0]} hold the target's own ids; re-extract {old[0]} into a fresh "
            "output_dir before training on both"
        )
    if old:
        log.warning("features in %s re-tokenize the target's replies from text (extracted by an earlier eagle3); "
                    "re-extract them to train on the target's own ids", ", ".join(map(str, old)))
    return layouts


def open_datasets(dirs: list[Path], target: Any, online: bool = False) -> tuple[FeatureDataset, FeatureDataset, list[int]]:
    """The training split (shards checksum-verified), the validation split, and the aux layer ids.

    ``online`` (``features=online``): the splits serve the kept replies alone (``input_ids``,
    ``loss_mask``) of features or replies-only folders; the features are captured while
    training, with the configured target's aux layer ids (the folder's need not match: the
    same replies serve an aux-layer ablation), after the same target check.

    Raises:
        Eagle3Error: a missing, empty, unfinished or incompatible features folder
            (:class:`~eagle3.features.FeatureDataset`), old and new sample layouts mixed
            (:func:`check_sample_layouts`), no training samples, features of
            another target (:func:`check_features_match_target`), or aux states whose width
            is not the target's hidden size.
    """
    train_ds = FeatureDataset(dirs, splits=("train",), features=not online)
    check_sample_layouts(train_ds.manifests, dirs)
    if len(train_ds) == 0:
        raise Eagle3Error(f"features in {', '.join(map(str, dirs))} hold no training samples; extract more data")
    val_ds = FeatureDataset(dirs, splits=("validation",), verify=False, features=not online)
    if online:
        meta = {**train_ds.metadata, "aux_layer_ids": list(target.aux_layer_ids)}
        return train_ds, val_ds, check_features_match_target(meta, target, dirs)
    aux_ids = check_features_match_target(train_ds.metadata, target, dirs)
    h_feat = train_ds[0]["aux_hidden_states"].shape[-1]
    if h_feat != target.hidden_size:
        raise Eagle3Error(f"features hold aux states of width {h_feat}, the target's hidden size is {target.hidden_size}")
    return train_ds, val_ds, aux_ids


def warn_on_degenerate_loss_mask(manifests: list[dict]) -> None:
    """Log a warning when over 99% of the training tokens carry loss (prompts masked in by mistake)."""
    masked = sum(sh["masked_tokens"] for m in manifests for sh in m["shards"])
    total = sum(sh["tokens"] for m in manifests for sh in m["shards"])
    if total and masked / total > 0.99:
        log.warning("%.1f%% of the tokens carry loss: the loss mask looks degenerate (prompts included?)",
                    100 * masked / total)


# ------------------------------------------------------------------- batching
def length_bucketed_batches(lengths: Sequence[int], max_tokens: int, seed: int, epoch: int,
                            pool: int = 512) -> list[list[int]]:
    """Batches of sample indices whose padded size ``B * max(len)`` fits ``max_tokens``.

    Deterministic in ``(seed, epoch)``: shuffle, cut into pools of ``pool`` samples,
    sort each pool by length, pack greedily, shuffle the batches. Samples longer than
    ``max_tokens`` form a batch alone (and are cut to ``max_tokens`` by the collator).
    """
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    order = torch.randperm(len(lengths), generator=g).tolist()
    batches: list[list[int]] = []
    for i in range(0, len(order), pool):
        chunk = sorted(order[i : i + pool], key=lambda j: (-min(lengths[j], max_tokens), j))
        cur: list[int] = []
        longest = 0
        for j in chunk:
            n = min(lengths[j], max_tokens)
            if cur and (len(cur) + 1) * max(longest, n) > max_tokens:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(j)
            longest = max(longest, n)
        if cur:
            batches.append(cur)
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[p] for p in perm]


def train_subset(num_samples: int, fraction: float, seed: int) -> Optional[tuple[int, ...]]:
    """The training samples a run with ``loop.train_fraction = fraction`` trains on.

    Returns ``None`` for ``fraction == 1`` (every sample), else the sorted indices of the first
    ``max(1, round(num_samples * fraction))`` samples of a permutation seeded by ``seed`` only:
    for one seed the subsets are nested (a smaller fraction's subset lies inside a larger
    one's), so the points of a learning curve differ only by the samples added.

    Raises:
        Eagle3Error: ``fraction`` outside ``(0, 1]``.
    """
    if not 0.0 < fraction <= 1.0:
        raise Eagle3Error(f"loop.train_fraction={fraction}: give a fraction of the training samples in (0, 1]")
    if fraction == 1.0:
        return None
    g = torch.Generator().manual_seed(int(seed) * 7_919 + 17)
    order = torch.randperm(num_samples, generator=g).tolist()
    return tuple(sorted(order[: max(1, round(num_samples * fraction))]))


@dataclass(frozen=True)
class BatchPlan:
    """The run's global micro-batch plan: which samples every optimizer step trains on.

    Attributes:
        lengths: token count of each training sample (``FeatureDataset.lengths``).
        max_tokens: padded-token budget of one micro-batch.
        seed: the run's seed (the order is a pure function of ``(seed, epoch)``).
        grad_accum: micro-batches per process in one optimizer step.
        world: the number of processes.
        samples: the training samples used (:func:`train_subset`); ``None`` = all of them.
    """

    lengths: Sequence[int]
    max_tokens: int
    seed: int
    grad_accum: int
    world: int
    samples: Optional[tuple[int, ...]] = None

    @property
    def num_samples(self) -> int:
        """Training samples the plan draws from."""
        return len(self.lengths) if self.samples is None else len(self.samples)

    @property
    def per_step(self) -> int:
        """Micro-batches in one optimizer step, over all processes."""
        return self.grad_accum * self.world

    def batches_of(self, epoch: int) -> list[list[int]]:
        """The epoch's global micro-batch list, cut to whole optimizer steps. Micro-batch
        ``i`` goes to process ``i % world``, so step ``k`` trains on global micro-batches
        ``k*per_step .. (k+1)*per_step - 1`` whatever the split between processes and
        accumulation: N processes x grad_accum g equal one process x grad_accum N*g."""
        if self.samples is None:
            b = length_bucketed_batches(self.lengths, self.max_tokens, self.seed, epoch)
        else:
            sub = [self.lengths[i] for i in self.samples]
            b = [[self.samples[j] for j in batch]
                 for batch in length_bucketed_batches(sub, self.max_tokens, self.seed, epoch)]
        return b[: len(b) - len(b) % self.per_step]

    def steps_per_epoch(self, epochs: int) -> list[int]:
        """Optimizer steps in each of the first ``max(1, epochs)`` epochs."""
        return [len(self.batches_of(e)) // self.per_step for e in range(max(1, epochs))]

    def round_tokens(self, epoch_batches: list[list[int]], first: int) -> int:
        """Tokens (each sample cut to ``max_tokens``) of the ``world`` global micro-batches
        ``first .. first + world - 1``: one round, one micro-batch per process."""
        return sum(min(self.lengths[j], self.max_tokens) for b in epoch_batches[first : first + self.world] for j in b)


def make_loader(ds: FeatureDataset, batch_lists: list[list[int]], collate_fn: Callable, num_workers: int,
                pin_memory: bool) -> torch.utils.data.DataLoader:
    """A ``DataLoader`` that yields ``collate_fn`` of each batch of ``batch_lists``, in order.

    Each iterator of a ``DataLoader`` draws its workers' base seed from the loader's generator, by
    default the global torch RNG; the loader has a generator of its own here, so the global RNG
    state that a checkpoint saves does not depend on how many loaders a launch opened (a resumed
    run opens one more for the rest of its epoch) and a resumed run's checkpoints equal an
    uninterrupted run's byte for byte. Nothing in the loader is random (the batches are given).
    """
    return torch.utils.data.DataLoader(
        ds, batch_sampler=batch_lists, collate_fn=collate_fn, num_workers=num_workers, pin_memory=pin_memory,
        persistent_workers=False, generator=torch.Generator().manual_seed(0),
    )
