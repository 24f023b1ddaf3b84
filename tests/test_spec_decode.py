"""Speculative decoding: exact tau with oracle/wrong drafters, losslessness, tree building, sampling."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3.errors import Eagle3Error
from eagle3.spec import (
    DraftProposer,
    DraftTree,
    SpecSettings,
    SpeculativeDecoder,
    TargetRunner,
    accept_chain_sampling,
    accept_greedy,
    accept_tree_sampling,
    build_draft,
    target_generate,
    target_probs,
    tree_ancestors,
)
from eagle3.spec.target import _compact_cache

V = 96


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_target(vocab=V, layers=4, seed=0, init=0.2, attn="sdpa"):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=init, tie_word_embeddings=False,
    )
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def target():
    return tiny_target()


PROMPT = [5, 17, 33, 2, 60, 8, 41]


class ReferenceProposer(DraftProposer):
    """Drafts from a known continuation ``reference`` (the target's own greedy output).

    mode "oracle": the reference token is the top draft token; "wrong": it is the
    lowest; "noisy": top / second / lowest by a fixed pseudo-random pattern. Other
    logits are a fixed pseudo-random function of the sequence position, so
    tree candidates are well defined.
    """

    def __init__(self, reference, vocab=V, mode="oracle", seed=0):
        self.reference, self.vocab, self.mode, self.seed = list(reference), vocab, mode, seed
        self.vocab_target_ids = torch.arange(vocab)
        self.aux_layer_ids = None
        self.begins = 0

    def reset(self):
        self.rows = None

    def _logits(self, rows):
        out = []
        for length, ok in rows:
            g = torch.Generator().manual_seed(1000 * self.seed + length)
            lg = torch.randn(self.vocab, generator=g)
            if ok and length < len(self.reference):
                t = self.reference[length]
                r = (length * 7 + self.seed) % 10
                if self.mode == "oracle" or (self.mode == "noisy" and r < 5):
                    lg[t] = lg.max() + 5.0
                elif self.mode == "noisy" and r < 8:  # t ranks second
                    other = (t + 1) % self.vocab
                    lg[t] = lg.max() + 1.0
                    lg[other] = lg[t] + 1.0
                else:
                    lg[t] = lg.min() - 1.0
            out.append(lg)
        return torch.stack(out)

    def begin(self, input_ids, aux, start):
        self.begins += 1
        length = start + input_ids.numel() + 1  # tokens known incl. the root
        self.rows = [(length, True)]
        return self._logits(self.rows)[0]

    def step(self, input_ids, parents, position):
        rows = []
        for tok, par in zip(input_ids.tolist(), parents.tolist()):
            length, ok = self.rows[par]
            ok = ok and length < len(self.reference) and tok == self.reference[length]
            rows.append((length + 1, ok))
        self.rows = rows
        return self._logits(rows)

    def end_round(self):
        self.rows = None


def greedy_reference(target, prompt, n):
    runner = TargetRunner(target)
    s, _ = SpecSettings.make(1, 1, 2, max_new_tokens=n)
    return list(prompt) + target_generate(runner, prompt, s).tokens


def run_spec(target, proposer, settings, prompt=PROMPT, stop=(), generator=None):
    dec = SpeculativeDecoder(TargetRunner(target), proposer, settings, stop)
    return dec.generate(prompt, generator)


# ----------------------------------------------------------------------------- settings
def test_settings_chain_forces_draft_tokens_and_tree_bounds():
    s, note = SpecSettings.make(5, 1, 4)
    assert s.num_draft_tokens == 6 and "ignored" in note
    s, note = SpecSettings.make(3, 1, 4)
    assert s.num_draft_tokens == 4 and note is None
    SpecSettings.make(3, 2, 1 + 2 + 2 * 4)  # the largest tree SGLang's building can offer
    with pytest.raises(Eagle3Error, match="2..11"):
        SpecSettings.make(3, 2, 12)
    with pytest.raises(Eagle3Error):
        SpecSettings.make(0, 1, 1)


# ----------------------------------------------------------------------------- exact tau
@pytest.mark.parametrize("steps", [1, 3, 5])
def test_oracle_chain_reaches_num_steps_plus_one(target, steps):
    rounds = 6
    n = 1 + rounds * (steps + 1)
    ref = greedy_reference(target, PROMPT, n + steps + 2)
    s, _ = SpecSettings.make(steps, 1, steps + 1, max_new_tokens=n)
    res = run_spec(target, ReferenceProposer(ref, mode="oracle"), s)
    assert res.tokens == ref[len(PROMPT):len(PROMPT) + n]
    assert res.verify_passes == rounds
    assert res.acceptance_length == steps + 1
    assert res.accepted_drafts == rounds * steps and res.accept_counts == [steps] * rounds


def test_wrong_chain_gets_tau_one(target):
    n = 20
    ref = greedy_reference(target, PROMPT, n + 8)
    s, _ = SpecSettings.make(3, 1, 4, max_new_tokens=n)
    res = run_spec(target, ReferenceProposer(ref, mode="wrong"), s)
    assert res.tokens == ref[len(PROMPT):len(PROMPT) + n]
    assert res.acceptance_length == 1.0 and res.accepted_drafts == 0
    assert res.verify_passes == n - 1


@pytest.mark.parametrize("topk,ndt", [(2, 6), (3, 8)])
def test_oracle_and_wrong_tree(target, topk, ndt):
    steps, rounds = 3, 5
    n = 1 + rounds * (steps + 1)
    ref = greedy_reference(target, PROMPT, n + 8)
    s, _ = SpecSettings.make(steps, topk, ndt, max_new_tokens=n)
    res = run_spec(target, ReferenceProposer(ref, mode="oracle"), s)
    assert res.tokens == ref[len(PROMPT):len(PROMPT) + n]
    assert res.acceptance_length == steps + 1
    res = run_spec(target, ReferenceProposer(ref, mode="wrong"), s)
    assert res.tokens == ref[len(PROMPT):len(PROMPT) + n]
    assert res.acceptance_length == 1.0


# ----------------------------------------------------------------------------- lossless
@pytest.mark.parametrize("topk,ndt,attn", [(1, 5, "sdpa"), (3, 10, "sdpa"), (3, 10, "eager")])
def test_partial_acceptance_is_lossless(topk, ndt, attn):
    target = tiny_target(attn=attn)
    n = 60
    ref = greedy_reference(target, PROMPT, n + 8)
    s, _ = SpecSettings.make(4, topk, ndt, max_new_tokens=n)
    prop = ReferenceProposer(ref, mode="noisy", seed=3)
    res = run_spec(target, prop, s)
    assert res.tokens == ref[len(PROMPT):len(PROMPT) + n]
    assert 1.0 < res.acceptance_length < 5.0
    assert res.emitted == n - 1 == len(res.tokens) - 1
    assert sum(a + 1 for a in res.accept_counts[:-1]) < res.emitted <= sum(a + 1 for a in res.accept_counts)
    assert len(set(res.accept_counts)) >= 3  # mixed outcomes exercised the rollback


def test_stop_token_ends_like_the_baseline(target):
    ref = greedy_reference(target, PROMPT, 40)
    gen = ref[len(PROMPT):]
    stop = gen[9]
    first = gen.index(stop)
    s, _ = SpecSettings.make(3, 1, 4, max_new_tokens=40)
    base = target_generate(TargetRunner(target), PROMPT, s, stop_ids=[stop])
    assert base.tokens == gen[: first + 1]
    res = run_spec(target, ReferenceProposer(ref, mode="oracle"), s, stop=[stop])
    assert res.tokens == base.tokens
    assert res.emitted == len(res.tokens) - 1


def test_first_token_stop_makes_no_verify_pass(target):
    ref = greedy_reference(target, PROMPT, 4)
    s, _ = SpecSettings.make(3, 1, 4, max_new_tokens=10)
    res = run_spec(target, ReferenceProposer(ref), s, stop=[ref[len(PROMPT)]])
    assert res.tokens == [ref[len(PROMPT)]] and res.verify_passes == 0
    assert math.isnan(res.acceptance_length)


# ----------------------------------------------------------------------------- pieces
def test_aux_hooks_match_output_hidden_states(target):
    runner = TargetRunner(target, aux_layer_ids=[1, 2, 3])
    ids = torch.tensor([PROMPT])
    _, aux = runner.forward(ids, torch.arange(len(PROMPT))[None], runner.new_cache())
    hs = target(ids, output_hidden_states=True).hidden_states
    ref = torch.cat([hs[1][0], hs[2][0], hs[3][0]], -1)
    torch.testing.assert_close(aux, ref)
    with pytest.raises(Eagle3Error, match="outside"):
        TargetRunner(target, aux_layer_ids=[1, 2, 9])


def test_tree_ancestors_hand_case():
    #      0
    #    1   2
    #   3     4
    #   5
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])
    anc = tree_ancestors(parents, 3)
    expect = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 2, 4}, 5: {0, 1, 3, 5}}
    for i, s in expect.items():
        assert set(torch.nonzero(anc[i]).flatten().tolist()) == s


def test_accept_greedy_walks_the_matching_path():
    tree = DraftTree(
        tokens=torch.tensor([9, 4, 7, 1, 2, 3]),
        parents=torch.tensor([-1, 0, 0, 1, 2, 3]),
        depth=torch.tensor([0, 1, 1, 2, 2, 3]),
    )
    logits = torch.zeros(6, 12)
    # target argmax at each node: root->7 (node 2), node 2 -> 2 (node 4), node 4 -> 11 (bonus)
    for node, tok in {0: 7, 1: 1, 2: 2, 3: 3, 4: 11, 5: 0}.items():
        logits[node, tok] = 1.0
    assert accept_greedy(tree, logits, 3) == ([0, 2, 4], [7, 2, 11])


def test_compact_cache_moves_tree_path():
    from transformers import DynamicCache

    cache = DynamicCache()
    k = torch.arange(10.0).view(1, 1, 10, 1).repeat(1, 2, 1, 3)
    cache.update(k.clone(), k.clone() + 100, 0)
    _compact_cache(cache, 4, torch.tensor([0, 2, 5]), contiguous=False)
    assert cache.get_seq_length() == 7
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 6, 9]
    assert cache.layers[0].values[0, 1, :, 0].tolist() == [100, 101, 102, 103, 104, 106, 109]


class PathProposer(DraftProposer):
    """Logits are a fixed pseudo-random function of the drafted path (for tree building)."""

    def __init__(self, vocab=12):
        self.vocab = vocab
        self.vocab_target_ids = torch.arange(vocab) + 100  # a d2t-like offset
        self.paths = None

    @staticmethod
    def logits_of(path, vocab):
        g = torch.Generator().manual_seed(hash(tuple(path)) % (2**31))
        return torch.randn(vocab, generator=g) * 2

    def reset(self):
        pass

    def begin(self, input_ids, aux, start):
        self.paths = [()]
        return self.logits_of((), self.vocab)

    def step(self, input_ids, parents, position):
        self.paths = [self.paths[p] + (t,) for t, p in zip(input_ids.tolist(), parents.tolist())]
        return torch.stack([self.logits_of(p, self.vocab) for p in self.paths])

    def end_round(self):
        pass


def reference_tree(vocab, topk, steps, ndt):
    """SGLang's selection written out with Python lists and probability products."""
    offset = 100

    def top(path):
        p = torch.softmax(PathProposer.logits_of(path, vocab), -1).tolist()
        return sorted(range(vocab), key=lambda i: -p[i])[:topk], p

    pool = []  # (score, path of target ids)
    ids, p = top(())
    expand = [(p[i], (i + offset,)) for i in ids]
    pool += expand
    for _ in range(1, steps):
        children = []
        for score, path in expand:
            ids, p = top(path)
            children += [(score * p[i], path + (i + offset,)) for i in ids]
        pool += children
        expand = sorted(children, key=lambda c: -c[0])[:topk]
    chosen = sorted(range(len(pool)), key=lambda i: -pool[i][0])[: ndt - 1]
    return {pool[i][1] for i in chosen}


@pytest.mark.parametrize("topk,steps,ndt", [(2, 3, 6), (3, 4, 12), (4, 2, 9), (2, 5, 11)])
def test_tree_building_matches_sglang_selection(topk, steps, ndt):
    s, _ = SpecSettings.make(steps, topk, ndt)
    prop = PathProposer()
    first = prop.begin(torch.tensor([1]), None, 0)
    tree = build_draft(prop, torch.tensor([7]), first, 0, s)
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    assert len(toks) == ndt and parents[0] == -1
    assert all(0 <= parents[j] < j for j in range(1, ndt))

    def path(j):
        out = []
        while j > 0:
            out.append(toks[j])
            j = parents[j]
        return tuple(reversed(out))

    assert {path(j) for j in range(1, ndt)} == reference_tree(prop.vocab, topk, steps, ndt)
    assert tree.depth.tolist() == [len(path(j)) for j in range(ndt)]


# ----------------------------------------------------------------------------- sampling
def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected=5.0) -> float:
    """Pearson chi-square goodness of fit; cells with small expectation are pooled."""
    n = counts.sum()
    exp = probs * n
    big = exp >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    ex = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = ex > 0
    obs, ex = obs[keep], ex[keep]
    stat = ((obs - ex) ** 2 / ex).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


def test_chain_speculative_sampling_kernel_is_exact():
    g = torch.Generator().manual_seed(0)
    Vs, k = 6, 2
    p = torch.softmax(torch.randn(k + 1, Vs, generator=g) * 1.5, -1)
    qd = torch.softmax(torch.randn(k, Vs, generator=g) * 1.5, -1)
    counts0 = torch.zeros(Vs)
    counts1 = torch.zeros(Vs)  # second token when the first draft was accepted
    n = 6000
    for _ in range(n):
        d = torch.multinomial(qd, 1, generator=g)[:, 0]
        tree = DraftTree(torch.cat([torch.tensor([0]), d]), torch.arange(-1, k), torch.arange(k + 1), qd)
        # p[1] stands for the target's distribution after the first draft (fixed here)
        path, toks = accept_chain_sampling(tree, p, torch.arange(Vs), g)
        assert toks[:-1] == d[: len(path) - 1].tolist()
        counts0[toks[0]] += 1
        if len(path) > 1:  # first draft accepted
            counts1[toks[1]] += 1
    assert chi2_pvalue(counts0, p[0]) > 1e-3
    assert chi2_pvalue(counts1, p[1]) > 1e-3
    # the test has power: the same counts reject the draft distribution
    assert chi2_pvalue(counts0, qd[0]) < 1e-6


def test_tree_sampling_kernel_is_exact():
    g = torch.Generator().manual_seed(1)
    Vs = 7
    # root with children tokens 3, 0, 5; node 1 (token 3) has children 1, 6
    tree = DraftTree(torch.tensor([2, 3, 0, 5, 1, 6]), torch.tensor([-1, 0, 0, 0, 1, 1]),
                     torch.tensor([0, 1, 1, 1, 2, 2]))
    p = torch.softmax(torch.randn(6, Vs, generator=g) * 1.5, -1)
    counts0, counts1 = torch.zeros(Vs), torch.zeros(Vs)
    for _ in range(6000):
        path, toks = accept_tree_sampling(tree, p, g)
        assert toks[:-1] == [tree.tokens[j].item() for j in path[1:]]
        counts0[toks[0]] += 1
        if toks[0] == 3:
            counts1[toks[1]] += 1
    assert chi2_pvalue(counts0, p[0]) > 1e-3
    assert chi2_pvalue(counts1, p[1]) > 1e-3
    assert chi2_pvalue(counts0, torch.full((Vs,), 1 / Vs)) < 1e-6


def exact_token_marginals(target, prompt, temperature):
    """Exact distributions of generated tokens 2 and 3 (sampling at `temperature`)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        p1 = target_probs(target(ids).logits[0, -1], temperature, 1.0)  # [V]
        Vt = p1.numel()
        seq2 = torch.cat([ids.repeat(Vt, 1), torch.arange(Vt)[:, None]], 1)
        p2 = target_probs(target(seq2).logits[:, -1], temperature, 1.0)  # [V, V]: p(x2 | x1)
        m2 = p1 @ p2
        joint12 = p1[:, None] * p2  # [V, V]
        seq3 = torch.cat(
            [seq2.repeat_interleave(Vt, 0), torch.arange(Vt).repeat(Vt)[:, None]], 1
        )  # [V*V, P+2]
        p3 = target_probs(target(seq3).logits[:, -1], temperature, 1.0)  # [V*V, V]
        m3 = (joint12.flatten()[:, None] * p3).sum(0)
    return m2, m3


@pytest.mark.parametrize("topk,ndt", [(1, 3), (2, 5)])
def test_sampling_end_to_end_matches_the_target_distribution(topk, ndt):
    vt = 16
    target = tiny_target(vocab=vt, layers=2, init=0.6, seed=2)
    prompt = [3, 9, 1]
    temperature = 0.9
    m2, m3 = exact_token_marginals(target, prompt, temperature)
    m2_hotter, _ = exact_token_marginals(target, prompt, 1.3)
    ref = greedy_reference(target, prompt, 8)
    s, _ = SpecSettings.make(2, topk, ndt, temperature=temperature, max_new_tokens=3)
    dec = SpeculativeDecoder(TargetRunner(target), ReferenceProposer(ref, vocab=vt, mode="noisy"), s)
    g = torch.Generator().manual_seed(0)
    c2, c3 = torch.zeros(vt), torch.zeros(vt)
    accepted = 0
    for _ in range(800):
        res = dec.generate(prompt, g)
        c2[res.tokens[1]] += 1
        c3[res.tokens[2]] += 1
        accepted += res.accepted_drafts
    assert accepted > 200  # drafts were accepted often enough to matter
    assert chi2_pvalue(c2, m2) > 1e-3
    assert chi2_pvalue(c3, m3) > 1e-3
    # power: the same counts reject the target's distribution at a nearby temperature
    assert chi2_pvalue(c2, m2_hotter) < 1e-6


# ----------------------------------------------------------------------------- EAGLE-3 drafter
def tiny_drafter(target, vocab_draft=48, seed=0, layers=1):
    from eagle3.model.drafter import DrafterArch, Eagle3Drafter

    cfg = target.config
    arch = DrafterArch(
        hidden_size=cfg.hidden_size, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, num_layers=layers, target_hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size, draft_vocab_size=vocab_draft,
    )
    torch.manual_seed(seed)
    d = Eagle3Drafter(arch)
    d.reset_parameters(std=0.3)
    ids = torch.randperm(cfg.vocab_size)[:vocab_draft].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    d.set_draft_vocab(ids - torch.arange(vocab_draft), t2d)
    d.init_from_target(target.get_input_embeddings().weight)
    return d.eval()


AUX = [1, 2, 3]  # HF output_hidden_states[L] is post-norm, so the reference avoids id L


class RecordingProposer:
    """Wraps an Eagle3Proposer and records (start, m, logits) of every begin and chain step 1."""

    def __init__(self, inner):
        self.inner = inner
        self.begins, self.steps = [], []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def begin(self, input_ids, aux, start):
        out = self.inner.begin(input_ids, aux, start)
        self.begins.append((start, input_ids.numel(), out.clone()))
        self._last_root_hidden = self.inner._hidden.clone()
        return out

    def step(self, input_ids, parents, position):
        out = self.inner.step(input_ids, parents, position)
        if len(self.steps) < len(self.begins):  # first step of this round
            self.steps.append((input_ids.clone(), position, out.clone()))
        return out


@pytest.mark.parametrize("topk,ndt,layers", [(1, 4, 1), (2, 6, 1), (1, 4, 2), (2, 6, 3)])
def test_eagle3_drafter_is_lossless_and_its_cache_matches_a_fresh_forward(target, topk, ndt, layers):
    from eagle3.spec import Eagle3Proposer

    drafter = tiny_drafter(target, layers=layers)
    n = 40
    ref = greedy_reference(target, PROMPT, n)
    s, _ = SpecSettings.make(3, topk, ndt, max_new_tokens=n)
    rec = RecordingProposer(Eagle3Proposer(drafter, AUX))
    dec = SpeculativeDecoder(TargetRunner(target, AUX), rec, s)
    res = dec.generate(PROMPT)
    assert res.tokens == ref[len(PROMPT):]
    assert res.verify_passes >= 2
    seq = torch.tensor(ref)
    with torch.no_grad():
        hs = target(seq[None], output_hidden_states=True).hidden_states
        aux_all = torch.cat([hs[k][0] for k in AUX], -1)  # [T, 3H]
        for r, (start, m, logits) in enumerate(rec.begins):
            L = start + m  # positions read with target features; seq[L] is the round's root
            out = drafter(seq[1 : L + 1][None], drafter.fuse(aux_all[:L][None]), torch.arange(L)[None])
            torch.testing.assert_close(logits, out.logits[0, -1], atol=1e-4, rtol=1e-4)
            if topk == 1:
                tok, pos, step_logits = rec.steps[r]
                assert pos == L
                ids = torch.cat([seq[1 : L + 1], tok])[None]
                hid = torch.cat([drafter.fuse(aux_all[:L][None]), out.hidden_states[:, -1:]], 1)
                chain = drafter(ids, hid, torch.arange(L + 1)[None])
                torch.testing.assert_close(step_logits[0], chain.logits[0, -1], atol=1e-4, rtol=1e-4)


def test_eagle3_tree_steps_equal_chains_along_each_path(target):
    from eagle3.spec import Eagle3Proposer

    drafter = tiny_drafter(target, seed=1)
    runner = TargetRunner(target, AUX)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        _, aux = runner.forward(ids, torch.arange(len(PROMPT))[None], runner.new_cache())
    new_ids = torch.tensor(PROMPT[1:] + [50])
    L = len(PROMPT)
    a, b, c, d = 11, 12, 13, 14

    def run(steps):
        p = Eagle3Proposer(drafter, AUX)
        with torch.no_grad():
            p.begin(new_ids, aux, 0)
            outs = [p.step(torch.tensor(t), torch.tensor(par), L + i) for i, (t, par) in enumerate(steps)]
        return outs

    tree = run([([a, b], [0, 0]), ([c, d], [1, 0])])  # c under b, d under a
    chain_c = run([([b], [0]), ([c], [0])])
    chain_d = run([([a], [0]), ([d], [0])])
    torch.testing.assert_close(tree[0][1], chain_c[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree[1][0], chain_c[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree[1][1], chain_d[1][0], atol=1e-5, rtol=1e-5)
