"""A learnable toy feature set and a tiny target description for the train-stage tests.

The target's next token is ``(3 * token + 1) mod V``; features are the token's
embedding plus noise, so a drafter learns it in a few steps. Sizes: hidden ``H = 16``,
vocabulary ``V = 64``, top-``K = 4`` logprobs per position, aux states of layers 2, 4, 5
(``[T, 3, H]`` bfloat16 as stored), 6 <= T < 20 tokens a sample.

:func:`write_target_and_features` also saves a real tiny float32 Llama of those sizes
(8 layers, 2 heads / 1 KV head, intermediate 32, 512 positions, random weights of seed 0)
and a features folder carrying its content hash, for tests that run ``train.py`` itself.
"""

import types

import torch
from omegaconf import OmegaConf

from eagle3.config import DataConfig, HFEngineConfig, ModelConfig, TrainConfig
from eagle3.features import Capture, FeatureWriter, Record

H, V, K = 16, 64, 4


def tiny_target(content_hash="sha256:tiny", **kw):
    d = dict(name="tiny", source="x", path=None, architecture="llama", num_layers=8, hidden_size=H, vocab_size=V,
             aux_layer_ids=[2, 4, 5], content_hash=content_hash, quantization={"method": "none"}, dtype="float32",
             rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512, num_attention_heads=2,
             num_key_value_heads=1, head_dim=8, intermediate_size=32)
    d.update(kw)
    return types.SimpleNamespace(**d)


def rule(ids):
    """The toy target's next token after each of ``ids``: ``(3 * id + 1) mod V``."""
    return (3 * ids + 1) % V


def toy_sequence(g, emb):
    """One toy sample drawn from ``g``: ``(ids [T] int32, aux [T, 3, H] float32)``, 6 <= T < 20.

    The ids follow :func:`rule` from a random first token; the three aux states of a
    position are the token's row of ``emb`` plus noise of std 0.1.
    """
    T = int(torch.randint(6, 20, (1,), generator=g))
    ids = [int(torch.randint(0, V, (1,), generator=g))]
    for _ in range(T - 1):
        ids.append(int(rule(ids[-1])))
    ids = torch.tensor(ids, dtype=torch.int32)
    aux = emb[ids.long()][:, None, :].repeat(1, 3, 1) + 0.1 * torch.randn(T, 3, H, generator=g)
    return ids, aux


def feature_table():
    """``[V, H]``: the toy target's hidden state of each token (before noise)."""
    return torch.randn(V, H, generator=torch.Generator().manual_seed(99))


def held_out(n=40, seed=12345):
    """``n`` toy samples for testing a trained drafter: ``[(ids [T] int64, aux [T, 3*H] float32
    rounded through bfloat16 as the features store it)]``. Drawn from their own seed, so
    their noise is none the training saw (their token chains may repeat training chains:
    a chain is fixed by its first token and length)."""
    g, emb = torch.Generator().manual_seed(seed), feature_table()
    out = []
    for _ in range(n):
        ids, aux = toy_sequence(g, emb)
        out.append((ids.long(), aux.bfloat16().float().reshape(len(ids), 3 * H)))
    return out


def write_features(d, n=24, content_hash="sha256:tiny", nan_ids=(), seed=0, val_every=6, no_labels=False,
                   huge_ids=()):
    """A learnable toy: the target's next token is (3 * token + 1) mod V. The samples of ``nan_ids``
    hold a NaN aux value; those of ``huge_ids`` finite aux states of 3e38 (bf16's largest is 3.39e38),
    which the collator keeps and ``drafter.feature_noise`` pushes past float32's range: a NaN training loss."""
    g = torch.Generator().manual_seed(seed)
    plan = [(f"s{i}", "validation" if i % val_every == val_every - 1 else "train") for i in range(n)]
    meta = {"target": {"content_hash": content_hash, "hidden_size": H, "vocab_size": V, "architecture": "llama",
                       "quantization": {"method": "none"}, "name": "tiny"},
            "aux_layer_ids": [2, 4, 5], "chat_template_hash": "sha256:tmpl", "capture": {"top_k": K}}
    w = FeatureWriter.open(d, meta, plan, samples_per_shard=8)
    emb = feature_table()
    for idx, chunk in w.pending():
        recs = []
        for sid, split in chunk:
            ids, aux = toy_sequence(g, emb)
            T = len(ids)
            if sid in nan_ids:
                aux[1, 0, 0] = float("nan")
            if sid in huge_ids:
                aux[:] = 3e38
            top = torch.stack([(3 * ids.long() + 1 + k) % V for k in range(K)], 1).int()
            lp = torch.log_softmax(torch.tensor([4.0, 1.0, 0.5, 0.0]), -1).expand(T, K).clone()
            mask = torch.ones(T, dtype=torch.uint8)
            mask[: T if no_labels else 2] = 0
            recs.append(Record(sid, split, ids, mask, Capture(aux.bfloat16(), top, lp)))
        w.write_shard(idx, recs)
    return w.finalize()


def make_cfg(features, out, **over):
    cfg = OmegaConf.structured(TrainConfig)
    cfg.model = OmegaConf.structured(ModelConfig(name="tiny", source="x"))
    cfg.data = OmegaConf.structured(DataConfig(name="toy", source="x"))
    cfg.engine = OmegaConf.structured(HFEngineConfig())
    cfg.features_dir = str(features)
    cfg.output_dir = str(out)
    cfg.device = "cpu"
    cfg.drafter.ttt_steps = 3
    cfg.drafter.draft_vocab_size = 48
    cfg.loop.max_tokens_per_batch = 48
    cfg.loop.log_every = 1
    cfg.loop.tracker = "none"
    cfg.loop.save_every = 1000
    cfg.optim.lr = 3e-3
    cfg.export.speculators = False
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return OmegaConf.to_object(cfg)


def embed():
    return torch.randn(V, H, generator=torch.Generator().manual_seed(7))


def write_target_and_features(target_dir, features_dir, cache_dir, n):
    """Save a tiny float32 ``LlamaForCausalLM`` of the toy's sizes (hidden H, vocabulary V, 8 layers,
    2 attention heads / 1 KV head, intermediate 32, 512 positions; weights drawn after
    ``torch.manual_seed(0)``) to ``target_dir``, resolve it as model ``tiny`` (float32, no quantization)
    with ``cache_dir`` as the cache, and write ``n`` toy samples (:func:`write_features`) to
    ``features_dir`` under that target's content hash, which is returned (``"sha256:..."``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3.target import resolve_target

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=H, intermediate_size=32, num_hidden_layers=8, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=V, max_position_embeddings=512)
                     ).save_pretrained(target_dir)
    mc = OmegaConf.to_object(OmegaConf.structured(ModelConfig(name="tiny", source=str(target_dir), dtype="float32")))
    mc.quantization.method = "none"
    content_hash = resolve_target(mc, cache_dir).content_hash
    write_features(features_dir, n=n, content_hash=content_hash)
    return content_hash
