"""Chat rendering and the offset-based assistant loss mask (real SmolLM2 tokenizer, ChatML)."""

import pytest
from transformers import AutoTokenizer

from eagle3.target import chat_template_hash, end_of_turn_ids, render_conversation, render_prompt, validate_messages
from eagle3.errors import Eagle3Error

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def _pieces_to_ids_mask(tok, pieces):
    ids, mask = [], []
    for text, m in pieces:
        t = tok(text, add_special_tokens=False)["input_ids"]
        ids += t
        mask += [m] * len(t)
    return ids, mask


def test_two_turn_mask_is_the_hand_computed_span(tok):
    msgs = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6, of course."},
    ]
    # hand-built: the ChatML text cut at the assistant spans; content + <|im_end|> are trainable
    pieces = [
        (SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("4", 1),
        ("<|im_end|>", 1),
        ("\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("6, of course.", 1),
        ("<|im_end|>", 1),
        ("\n", 0),
    ]
    want_ids, want_mask = _pieces_to_ids_mask(tok, pieces)
    ids, mask = render_conversation(tok, msgs)
    assert ids == want_ids
    assert mask == want_mask
    assert 0 < sum(mask) / len(mask) < 1
    # exactly the two answers and their end-of-turn tokens
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "4<|im_end|>6, of course.<|im_end|>"


def test_system_prompt_kept_and_unmasked(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
    ]
    ids, mask = render_conversation(tok, msgs)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Hello there<|im_end|>"


def test_assistant_content_repeating_user_text_is_found_at_its_own_turn(tok):
    msgs = [
        {"role": "user", "content": "echo"},
        {"role": "assistant", "content": "echo"},
    ]
    ids, mask = render_conversation(tok, msgs)
    masked_pos = [k for k, m in enumerate(mask) if m]
    # the masked tokens come after the last <|im_start|>assistant header, not in the user turn
    header_end = len(tok(SYSTEM + "<|im_start|>user\necho<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
    assert masked_pos[0] == header_end
    assert tok.decode([ids[k] for k in masked_pos]) == "echo<|im_end|>"


def test_render_prompt_matches_transformers(tok):
    msgs = [{"role": "user", "content": "Tell me a joke."}]
    want = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert render_prompt(tok, msgs) == list(want)
    assert tok.decode(render_prompt(tok, msgs)).endswith("<|im_start|>assistant\n")


def test_end_of_turn_and_template_hash(tok):
    assert end_of_turn_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>")]
    h = chat_template_hash(tok)
    assert h.startswith("sha256:") and len(h) == 7 + 64
    import copy

    other = copy.deepcopy(tok)
    other.chat_template = tok.chat_template.replace("helpful", "useful")
    assert chat_template_hash(other) != h


def test_template_without_assistant_content_is_a_clear_error(tok):
    import copy

    bad = copy.deepcopy(tok)
    # a template that drops assistant messages: the mask would be all zero
    bad.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(Eagle3Error, match="verbatim|loss mask"):
        render_conversation(bad, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "zzqq unusual"}])


@pytest.mark.parametrize(
    "msgs, match",
    [
        ([], "empty"),
        ([{"role": "assistant", "content": "hi"}], "no user turn"),
        ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "hi"}], "no user turn"),
        ([{"role": "robot", "content": "hi"}], "role"),
        ([{"role": "user", "content": None}], "string content"),
    ],
)
def test_invalid_conversations(msgs, match):
    with pytest.raises(Eagle3Error, match=match):
        validate_messages(msgs, "x.jsonl:3")
