"""Captured samples are the target's own ids: the id layout of regenerated conversations, replies cut at the
token limit, old manifests, and the top-k order on tied logits (real SmolLM2 tokenizer, tiny random target)."""

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from eagle3.config import CaptureConfig, DataConfig, ExtractConfig, HFEngineConfig, ModelConfig, SamplingConfig
from eagle3.errors import Eagle3Error
from eagle3.extract.regenerate import generated_mask, regenerate
from eagle3.features import Capture, FeatureDataset, FeatureWriter, Record
from eagle3.features.format import rank_top_k, sample_layout
from eagle3.target import render_conversation
from eagle3.target.chat import close_reply, reply_tail_ids

pytestmark = pytest.mark.usefixtures("one_thread")

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------ the template's tail after a reply
def test_the_tail_after_a_reply_is_the_templates_text_after_its_content(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    history = [{"role": "user", "content": "hi"}]
    nxt = {"role": "user", "content": "and then?"}
    assert reply_tail_ids(tok, history, nxt) == _ids(tok, "<|im_end|>\n<|im_start|>user\nand then?<|im_end|>\n"
                                                      "<|im_start|>assistant\n")
    assert reply_tail_ids(tok, history, None) == [im_end] + _ids(tok, "\n")
    tail = reply_tail_ids(tok, history, nxt)
    eot = {im_end}
    assert close_reply([7, 8, im_end], tail, eot) == tail[1:]  # the target's own <|im_end|> is not written twice
    assert close_reply([7, 8, 9], tail, eot) == tail  # a cut reply: the template's <|im_end|> closes it
    assert close_reply([7, 0], tail, {0, im_end}) == tail[1:]  # another end-of-turn id (EOS) takes the marker's place
    assert close_reply([], tail, eot) == tail


def test_generated_mask_covers_the_spans_and_is_cut_at_the_length():
    assert generated_mask(8, [[2, 4], [6, 10]]) == [0, 0, 1, 1, 0, 0, 1, 1]
    assert generated_mask(3, [[1, 2]]) == [0, 1, 0]


# ------------------------------------------------------------------ regeneration keeps the engine's ids
class _SpellingEngine:
    """Replies by spelling words letter by letter (a segmentation the tokenizer never produces for them);
    the reply to user turn 1 ends with <|im_end|>, later ones are cut (no end-of-turn). Records its prompts."""

    def __init__(self, tok):
        self.tok, self.prompts = tok, []
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, sampling):
        outs = []
        for p in prompts:
            self.prompts.append(list(p))
            turn = self.tok.decode(p).count("<|im_start|>user")
            letters = [self.tok.convert_tokens_to_ids(c) for c in "hello"]
            outs.append(letters + [self.im_end] if turn == 1 else letters[: sampling.max_new_tokens])
        return outs


def test_regenerated_samples_are_exactly_what_the_engine_was_given_and_generated(tok):
    eng = _SpellingEngine(tok)
    im_end = eng.im_end
    letters = [tok.convert_tokens_to_ids(c) for c in "hello"]
    assert _ids(tok, "hello") != letters  # precondition: re-tokenizing the text would segment it otherwise
    convs = [("a", [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "old"},
                    {"role": "user", "content": "u2"}])]
    messages, seqs, st = regenerate(eng, tok, convs, SamplingConfig(max_new_tokens=5), max_length=200, seed=0)
    assert messages["a"][-1] == {"role": "assistant", "content": "hello"}
    p1 = _ids(tok, SYSTEM + "<|im_start|>user\nu1<|im_end|>\n<|im_start|>assistant\n")
    # turn 2's prompt: turn 1's sequence with the target's own <|im_end|>, then the template's next turn
    p2 = p1 + letters + [im_end] + _ids(tok, "\n<|im_start|>user\nu2<|im_end|>\n<|im_start|>assistant\n")
    assert eng.prompts == [p1, p2]
    # turn 2 was cut at max_new_tokens: the template writes <|im_end|> and "\n" after it
    assert seqs["a"]["input_ids"] == p2 + letters + [im_end] + _ids(tok, "\n")
    assert seqs["a"]["generated"] == [[len(p1), len(p1) + 6], [len(p2), len(p2) + 5]]
    mask = generated_mask(len(seqs["a"]["input_ids"]), seqs["a"]["generated"])
    assert sum(mask) == 11 and mask[-2:] == [0, 0]  # the template's <|im_end|> after the cut reply is no label
    # the text path would have given another sequence (and labelled the last <|im_end|>)
    text_ids, text_mask = render_conversation(tok, messages["a"])
    assert text_ids != seqs["a"]["input_ids"] and text_mask[-2] == 1
    assert st["generated_by_id"] == {"a": 11} and st["cut"] == []


def test_a_second_prompt_too_long_stops_the_conversation_closed_by_the_template(tok):
    eng = _SpellingEngine(tok)
    convs = [("d", [{"role": "user", "content": "hi"}, {"role": "user", "content": "y " * 150}])]
    _, seqs, st = regenerate(eng, tok, convs, SamplingConfig(max_new_tokens=8), max_length=120, seed=0)
    p1 = eng.prompts[0]
    assert st["cut"] == ["d"] and len(eng.prompts) == 1
    letters = [tok.convert_tokens_to_ids(c) for c in "hello"]
    assert seqs["d"]["input_ids"] == p1 + letters + [eng.im_end] + _ids(tok, "\n")


# ------------------------------------------------------------------ the extract stage on the tiny target
def _cfg(tiny_target_dir, tmp_path, data, out, **kw):
    return ExtractConfig(
        model=ModelConfig(name="tiny", source=str(tiny_target_dir)),
        engine=HFEngineConfig(device="cpu", generate_batch_size=2, capture_batch_size=2, max_batch_tokens=512),
        data=DataConfig(name="chats", source="jsonl", path=str(data), validation_fraction=0.0, test_fraction=0.0),
        sampling=SamplingConfig(max_new_tokens=kw.pop("max_new_tokens", 6)),
        capture=CaptureConfig(top_k=4, max_length=200, shard_size_mb=0.08, max_turns=None),  # every turn
        output_dir=str(out), cache_dir=str(tmp_path / "cache"), **kw)


def test_multi_turn_extraction_prompts_are_prefixes_of_the_captured_sample(tiny_target_dir, tmp_path, monkeypatch):
    """Every prompt the hf engine was given is the captured sample up to its reply, the generated ids follow
    it unchanged, and the mask is 1 on exactly those ids (random target: replies the tokenizer would often
    segment otherwise)."""
    from eagle3.engines.hf.engine import HFEngine
    from eagle3.extract.run import run_extract

    calls = []
    real = HFEngine.generate

    def generate(self, prompts, sampling):
        outs = real(self, prompts, sampling)
        calls.extend(zip(map(list, prompts), outs))
        return outs

    monkeypatch.setattr(HFEngine, "generate", generate)
    chats = [{"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"},
                           {"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "Fine"},
                           {"role": "user", "content": "Bye."}]},
             {"messages": [{"role": "user", "content": "2+2?"}]}]
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    run_extract(_cfg(tiny_target_dir, tmp_path, data, tmp_path / "out"))
    ds = FeatureDataset(tmp_path / "out", splits=("train",))
    assert ds.metadata["sample_layout"] == "target_ids"
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    im_end, newline = tok.convert_tokens_to_ids("<|im_end|>"), _ids(tok, "\n")
    turns = {}
    for i in range(len(ds)):
        x = ds[i]
        ids, mask = x["input_ids"].tolist(), x["loss_mask"].tolist()
        mine = sorted(((p, o) for p, o in calls if ids[: len(p)] == p), key=lambda po: len(po[0]))
        turns[x["sample_id"]] = len(mine)
        spans = [(len(p), len(p) + len(o)) for p, o in mine]
        for (p, o), (a, b) in zip(mine, spans):
            assert ids[a:b] == o  # the generated ids, unchanged
        assert [t for t, m in enumerate(mask) if m] == [t for a, b in spans for t in range(a, b)]
        # after the last reply: the template's closing, with <|im_end|> only when the target did not end it
        last = mine[-1][1]
        assert ids[spans[-1][1]:] == (newline if last[-1] == im_end else [im_end] + newline)
    assert turns == {"c-1": 3, "c-2": 1}


def test_a_tie_in_the_logits_captures_the_lowest_id_first_as_the_verifier_takes_it(tiny_target_dir, tmp_path):
    """lm_head rows made equal (and dominant) for five ids: every position's logits tie there; the captured
    top-1 is the lowest of them, the argmax the verifier takes, and all five come first in id order."""
    from eagle3.engines.hf.engine import HFEngine

    eng = HFEngine.from_config(ModelConfig(name="tiny", source=str(tiny_target_dir)), HFEngineConfig(device="cpu"),
                               tmp_path / "cache")
    tied = torch.tensor([5, 100, 7000, 20000, 40000])
    seq = list(range(300, 340))
    with torch.no_grad():
        h = eng._base(input_ids=torch.tensor([seq])).last_hidden_state[0].float()  # [T, H] after the final norm
        d = h.mean(0)
        assert (h @ d > 0).all()  # precondition: one direction positive at every position
        w = eng._lm_head.weight
        w.mul_(0.01)
        w[tied] = (d / d.norm() * 4).to(w.dtype)  # the same row five times, dominant: the maximum everywhere
    (cap,) = eng.capture([seq], top_k=5)
    with torch.no_grad():
        logits = eng.model(input_ids=torch.tensor([seq])).logits[0]  # [T, V] as the verifier computes them
    assert (logits[:, tied] == logits[:, tied[:1]]).all()  # precondition: exact ties
    assert torch.equal(logits.argmax(-1), torch.full((len(seq),), 5))
    assert torch.equal(cap.topk_ids[:, 0].long(), logits.argmax(-1))
    assert torch.equal(cap.topk_ids.long(), tied.expand(len(seq), -1))
    lp = torch.log_softmax(logits.float(), -1)
    # the capture's lm_head and logsumexp run on its own batch of rows, the verifier's on the model's forward: the
    # bf16 logits can round differently (1.5e-4 apart in log-prob on a 2-core AVX-512 CPU without AMX; below 1e-4 on AMX)
    assert torch.allclose(cap.topk_logprobs, lp[:, tied], atol=1e-3)


# ------------------------------------------------------------------ rank_top_k
def test_rank_top_k_orders_ties_by_id_and_keeps_the_argmax_first():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0],   # three tie for the max, k=2: ids 1, 2
                      [2.0, 2.0, 2.0, 2.0, 2.0],   # all tie
                      [0.0, 1.0, 5.0, 1.0, 4.0]])  # no tie at the top, a tie for third
    ids, vals = rank_top_k(x, 2)
    assert ids.tolist() == [[1, 2], [0, 1], [2, 4]] and vals.tolist() == [[3, 3], [2, 2], [5, 4]]
    ids, _ = rank_top_k(x, 4)
    assert ids.tolist() == [[1, 2, 4, 0], [0, 1, 2, 3], [2, 4, 1, 3]]
    assert rank_top_k(x, 5)[0][1].tolist() == [0, 1, 2, 3, 4]
    # many ties: a stable descending sort cut at k (the reference), whose column 0 is argmax
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (300, 64), generator=g).to(torch.bfloat16).float()
    for k in (1, 6, 20):
        ids, vals = rank_top_k(y, k)
        ref = torch.sort(y, dim=-1, descending=True, stable=True)
        assert torch.equal(ids, ref.indices[:, :k]) and torch.equal(vals, ref.values[:, :k])
        assert torch.equal(ids[:, 0], y.argmax(-1))


# ------------------------------------------------------------------ manifests from before the layout field
def _record(sid, T=6, H=8):
    return Record(sid, "train", torch.arange(T, dtype=torch.int32), (torch.arange(T) >= 3).to(torch.uint8),
                  Capture(torch.zeros(T, 3, H).bfloat16(), torch.zeros(T, 4, dtype=torch.int32), torch.zeros(T, 4)))


def _folder(d, meta):
    w = FeatureWriter.open(d, meta, [("s0", "train")], samples_per_shard=1)
    for idx, chunk in w.pending():
        w.write_shard(idx, [_record(sid) for sid, _ in chunk])
    w.finalize({})


META = {"target": {"content_hash": "h", "hidden_size": 8}, "aux_layer_ids": [2, 4, 5], "capture": {"top_k": 4}}


def test_sample_layout_of_old_and_new_manifests():
    assert sample_layout({"regenerate": True}) == "retokenized_replies"
    assert sample_layout({}) == "retokenized_replies"
    assert sample_layout({"regenerate": False}) == "template_text"
    assert sample_layout({"regenerate": True, "sample_layout": "target_ids"}) == "target_ids"


def test_an_old_folder_is_not_resumed_with_the_new_layout_but_one_of_kept_replies_is(tmp_path):
    old = tmp_path / "old"
    FeatureWriter.open(old, {**META, "regenerate": True}, [("s0", "train")], samples_per_shard=1)
    with pytest.raises(Eagle3Error, match=r"earlier eagle3 .*tokenized again.*new output_dir"):
        FeatureWriter.open(old, {**META, "regenerate": True, "sample_layout": "target_ids"}, [("s0", "train")], 1)
    kept = tmp_path / "kept"
    FeatureWriter.open(kept, {**META, "regenerate": False}, [("s0", "train")], samples_per_shard=1)
    w = FeatureWriter.open(kept, {**META, "regenerate": False, "sample_layout": "template_text"}, [("s0", "train")], 1)
    assert w.manifest["metadata"]["sample_layout"] == "template_text"


def test_training_refuses_to_mix_old_and_new_layouts(tmp_path):
    from eagle3.train.data import open_datasets

    _folder(tmp_path / "old", {**META, "regenerate": True})
    _folder(tmp_path / "new", {**META, "regenerate": True, "sample_layout": "target_ids"})
    _folder(tmp_path / "kept", {**META, "regenerate": False, "sample_layout": "template_text"})
    target = SimpleNamespace(name="t", content_hash="h", hidden_size=8, vocab_size=None, aux_layer_ids=[2, 4, 5])
    with pytest.raises(Eagle3Error, match=r"old hold the target's replies tokenized again.*re-extract"):
        open_datasets([tmp_path / "old", tmp_path / "new"], target)
    for dirs in (["old"], ["new"], ["new", "kept"], ["old", "kept"]):
        train, _, aux = open_datasets([tmp_path / d for d in dirs], target)
        assert len(train) == len(dirs) and aux == [2, 4, 5]
