"""A Kimi-kind tokenizer (tiktoken, remote code, no fast version) through the project's
tokenizer loading, chat rendering, assistant loss mask, and the extract stage's samples.

Kimi-K2.5's own tokenizer cannot be fetched here, so the fixture builds one of its kind
into a temporary folder: ``tokenization_kimi_test.py`` (tests/fixtures/kimi_tokenizer/,
a ``PreTrainedTokenizer`` on a ``tiktoken.Encoding``, as Kimi's ``tokenization_kimi.py``),
a ranks file converted from SmolLM2's byte-level BPE vocabulary (its token strings mapped
back to bytes, ranked in id order), Kimi's special tokens right after the ranks, and a
chat template of Kimi's shape (``<|im_user|>user<|im_middle|>...<|im_end|>``; an assistant
turn opens with ``<think>...</think>``, written empty by the template when the content
has no thinking of its own).
"""

from __future__ import annotations

import base64
import json
import shutil
import sys
from pathlib import Path

import pytest

tiktoken = pytest.importorskip("tiktoken")

from eagle3.config import ModelConfig, SamplingConfig  # noqa: E402
from eagle3.errors import Eagle3Error  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "kimi_tokenizer"
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
            "<think>", "</think>", "[UNK]", "[PAD]"]  # ids n_base + 0, 1, ... (Kimi's order of the first few)
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if not m['content'].startswith('<think>') -%}<think></think>{%- endif -%}{{ m['content'] }}<|im_end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
HEAD = "<|im_assistant|>assistant<|im_middle|>"


def _ranks_from_smollm2() -> list[bytes]:
    """SmolLM2's byte-level tokens as bytes, in id order, its own special tokens left out."""
    sys.path.insert(0, str(FIXTURE))
    try:
        from tokenization_kimi_test import bytes_to_unicode
    finally:
        sys.path.remove(str(FIXTURE))
    from conftest import smollm2_tokenizer

    smol = smollm2_tokenizer()
    skip = set(smol.added_tokens_encoder)
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    return [bytes(to_byte[c] for c in s) for s, _ in sorted(smol.get_vocab().items(), key=lambda kv: kv[1])
            if s not in skip]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    """``(folder, n_base)``: the Kimi-kind tokenizer folder and the number of BPE ranks."""
    out = tmp_path_factory.mktemp("kimi_kind_tokenizer")
    ranks = _ranks_from_smollm2()
    (out / "tiktoken.model").write_text("".join(f"{base64.b64encode(b).decode()} {r}\n" for r, b in enumerate(ranks)))
    n = len(ranks)
    added = {str(n + k): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                          "special": True} for k, s in enumerate(SPECIALS)}
    cfg = {"tokenizer_class": "KimiKindTokenizer",
           "auto_map": {"AutoTokenizer": ["tokenization_kimi_test.KimiKindTokenizer", None]},
           "added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]",
           "pad_token": "[PAD]", "additional_special_tokens": SPECIALS[2:9], "chat_template": TEMPLATE,
           "model_max_length": 1048576}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    shutil.copy(FIXTURE / "tokenization_kimi_test.py", out)
    return out, n


@pytest.fixture(scope="module")
def tok(kimi_dir, tmp_path_factory):
    from eagle3.target.load import load_tokenizer

    cfg = ModelConfig(name="kimi-kind", source="moonshotai/Kimi-K2.5", tokenizer=str(kimi_dir[0]), trust_remote_code=True)
    return load_tokenizer(cfg, tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def encoding(kimi_dir):
    """The same BPE built straight from the ranks file with tiktoken (an independent encoder)."""
    sys.path.insert(0, str(FIXTURE))
    try:
        from tokenization_kimi_test import PAT_STR, load_ranks
    finally:
        sys.path.remove(str(FIXTURE))
    folder, n = kimi_dir
    specials = {s: n + k for k, s in enumerate(SPECIALS)}
    return tiktoken.Encoding("check", pat_str=PAT_STR, mergeable_ranks=load_ranks(str(folder / "tiktoken.model")),
                             special_tokens=specials)


def _ids(encoding, text: str) -> list[int]:
    return encoding.encode(text, allowed_special="all")


def test_load_tokenizer_runs_the_remote_code_and_needs_trust(tok, kimi_dir, tmp_path):
    from eagle3.target.load import load_tokenizer

    folder, n = kimi_dir
    assert type(tok).__name__ == "KimiKindTokenizer" and not tok.is_fast
    assert tok.chat_template == TEMPLATE and tok.padding_side == "left"
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("[EOS]", n + 1, n + 10)
    assert len(tok) == n + 16  # ranks + Kimi-style reserved special block (16 here)
    cfg = ModelConfig(name="kimi-kind", source="moonshotai/Kimi-K2.5", tokenizer=str(folder), trust_remote_code=False)
    with pytest.raises(Eagle3Error, match="model.tokenizer="):
        load_tokenizer(cfg, tmp_path)


def test_special_tokens_are_single_ids(tok, kimi_dir):
    n = kimi_dir[1]
    for k, s in enumerate(SPECIALS):
        assert tok(s, add_special_tokens=False)["input_ids"] == [n + k], s
        assert tok.convert_tokens_to_ids(s) == n + k
        assert tok.decode([n + k]) == s
    assert tok("a<think>b</think>c", add_special_tokens=False)["input_ids"][1::2] == [n + 7, n + 8]


@pytest.mark.parametrize("text", [
    "Hello, world!", "  two  spaces\n\nand lines\t\ttabs", "def f(x):\n    return x ** 2  # square\n",
    "中文混合 English 123456789", "emoji 🙂🚀 and é, ñ, ß", "<think>x = 1?</think>The answer.<|im_end|>",
])
def test_encode_matches_tiktoken_and_round_trips(tok, encoding, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == _ids(encoding, text)
    assert tok.decode(ids) == text


def test_end_of_turn_is_im_end_besides_eos(tok, kimi_dir):
    from eagle3.target import end_of_turn_ids

    n = kimi_dir[1]
    assert end_of_turn_ids(tok) == [n + 1, n + 2]  # [EOS] and the template's <|im_end|>


def test_render_conversation_masks_the_replies_thinking_included(tok, encoding):
    from eagle3.target import render_conversation

    reply1 = "<think>2 加 2 是 4。</think>It is 4 🙂."
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": reply1},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because."},
    ]
    pieces = [
        ("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>2+2?<|im_end|>" + HEAD, 0),
        (reply1 + "<|im_end|>", 1),
        ("<|im_user|>user<|im_middle|>Why?<|im_end|>" + HEAD + "<think></think>", 0),  # template's empty thinking
        ("Because.<|im_end|>", 1),
    ]
    want_ids, want_mask = [], []
    for text, m in pieces:  # every cut is at a special token, so pieces tokenize as the whole does
        t = _ids(encoding, text)
        want_ids += t
        want_mask += [m] * len(t)
    ids, mask = render_conversation(tok, msgs)
    assert ids == want_ids and mask == want_mask
    masked = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(masked) == reply1 + "<|im_end|>Because.<|im_end|>"
    assert sum(mask) == len(_ids(encoding, reply1)) + 1 + len(_ids(encoding, "Because.")) + 1


def test_decoded_offsets_give_a_split_character_its_span_and_refuse_a_rewriting_decode(tok, encoding, monkeypatch):
    from eagle3.target.chat import _decoded_offsets

    ids = _ids(encoding, "ab") + [encoding.encode_single_token(bytes([b])) for b in "好".encode()] + _ids(encoding, "<think>")
    assert len(ids) == 5  # "ab" is one rank
    assert _decoded_offsets(tok, "ab好<think>", ids) == [(0, 2), (2, 3), (2, 3), (2, 3), (3, 10)]
    monkeypatch.setattr(type(tok), "decode", lambda self, ids, **kw: "X" * len(ids))
    with pytest.raises(Eagle3Error, match="do not spell"):
        _decoded_offsets(tok, "ab好<think>", ids)


def test_render_prompt_ends_with_the_generation_prompt(tok, encoding):
    from eagle3.target import render_prompt

    ids = render_prompt(tok, [{"role": "user", "content": "hi"}])
    assert ids == _ids(encoding, "<|im_user|>user<|im_middle|>hi<|im_end|>" + HEAD)


class _ThinkingEngine:
    """Replies with ids, not text: ``<think>``, reasoning, ``</think>``, an answer, ``<|im_end|>``;
    the reasoning holds a non-canonical split ("hel" + "lo", which re-tokenizing would merge)
    and a Chinese character split into its byte tokens. Records prompts and replies."""

    def __init__(self, tok, encoding, n_base):
        self.tok, self.enc, self.n = tok, encoding, n_base
        self.prompts, self.replies = [], []

    def generate(self, prompts, sampling):
        outs = []
        for p in prompts:
            turn = self.tok.decode(p).count("<|im_user|>")
            think = ([self.n + 7] + self.enc.encode(f"Turn {turn}: say") + self.enc.encode(" hel") + self.enc.encode("lo")
                     + [self.enc.encode_single_token(bytes([b])) for b in "好".encode()] + [self.n + 8])
            out = think + self.enc.encode(f"Hello {turn}.") + [self.n + 2]
            outs.append(out[: sampling.max_new_tokens])
        self.prompts += prompts
        self.replies += outs
        return outs


def test_extracted_samples_keep_every_generated_id_thinking_included(tok, encoding, kimi_dir):
    from eagle3.extract.regenerate import regenerate
    from eagle3.extract.shards import _render_shard, _Replies

    n = kimi_dir[1]
    eng = _ThinkingEngine(tok, encoding, n)
    convs = [("a", [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "old"},
                    {"role": "user", "content": "u2"}]),
             ("b", [{"role": "user", "content": "only"}])]
    msgs, seqs, st = regenerate(eng, tok, convs, SamplingConfig(max_new_tokens=64), max_length=512, seed=0)
    replies = _Replies(msgs, seqs, set(st["too_long"]), set(st["cut"]), st["generated_by_id"])
    records, dropped, truncated = _render_shard(tok, [("a", "train"), ("b", "train")], replies, 512)
    assert dropped == {} and truncated == []
    by_id = {sid: (ids, mask) for sid, _, ids, mask in records}
    a1, b1, a2 = eng.replies  # turn 1 of a and b, then turn 2 of a
    assert n + 7 in a1 and n + 8 in a1 and a1 != _ids(encoding, tok.decode(a1))  # thinking ids; not re-tokenizable
    # the stored ids: the template's text around the replies, and the replies' ids as generated
    user = "<|im_user|>user<|im_middle|>{}<|im_end|>" + HEAD
    ids, mask = by_id["a"]
    assert ids == _ids(encoding, user.format("u1")) + a1 + _ids(encoding, user.format("u2")) + a2
    assert [t for t, m in zip(ids, mask) if m] == a1 + a2  # every generated id a label, nothing else
    ids, mask = by_id["b"]
    assert ids == _ids(encoding, user.format("only")) + b1
    assert [t for t, m in zip(ids, mask) if m] == b1
    assert st["generated_by_id"] == {"a": len(a1) + len(a2), "b": len(b1)}
    # the readable record decodes without special tokens: <think> and </think> are not in it
    assert msgs["b"][-1]["content"] == "Turn 1: say hello好Hello 1."


def test_a_reply_cut_inside_its_thinking_keeps_every_id_and_closes_unlabelled(tok, encoding, kimi_dir):
    from eagle3.extract.regenerate import generated_mask, regenerate

    n = kimi_dir[1]
    eng = _ThinkingEngine(tok, encoding, n)
    _, seqs, _ = regenerate(eng, tok, [("c", [{"role": "user", "content": "q"}])], SamplingConfig(max_new_tokens=5),
                            max_length=512, seed=0)
    (out,) = eng.replies
    assert len(out) == 5 and out[0] == n + 7 and n + 8 not in out  # cut inside the thinking
    ids = seqs["c"]["input_ids"]
    assert ids == _ids(encoding, "<|im_user|>user<|im_middle|>q<|im_end|>" + HEAD) + out + [n + 2]
    assert generated_mask(len(ids), seqs["c"]["generated"]) == [0] * (len(ids) - 6) + [1] * 5 + [0]
