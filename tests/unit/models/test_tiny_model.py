"""The locally built char-level tokenizer and tiny Llama: exact round trips and save/load by path."""

from __future__ import annotations

import string

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nemo_like.data.chat_templates import CHATML_TEMPLATE
from nemo_like.models.tiny import SPECIAL_TOKENS, build_char_tokenizer, build_tiny_llama

TRICKY = [
    "",
    " ",
    "  two leading, two trailing  ",
    "a\nb\n\n",
    "\n\n",
    "tab\there",
    "\\boxed{12}",
    "{}[]()<>",
    "a  b   c",
    "#### 42.",
    string.printable,
]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_exact(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text


def test_default_encoding_adds_nothing(tok):
    assert tok("12+3=")["input_ids"] == tok("12+3=", add_special_tokens=False)["input_ids"]
    assert tok.bos_token is None


def test_every_printable_char_is_its_own_known_token(tok):
    ids = [tok(ch, add_special_tokens=False)["input_ids"] for ch in string.printable]
    assert all(len(i) == 1 for i in ids)
    flat = [i[0] for i in ids]
    assert len(set(flat)) == len(string.printable)
    assert tok.unk_token_id not in flat


def test_unknown_char_maps_to_unk(tok):
    assert tok("aéb", add_special_tokens=False)["input_ids"] == [
        tok.convert_tokens_to_ids("a"),
        tok.unk_token_id,
        tok.convert_tokens_to_ids("b"),
    ]
    assert tok.unk_token == "<|unk|>"


def test_special_tokens_are_single_ids(tok):
    ids = []
    for special in SPECIAL_TOKENS:
        encoded = tok(special, add_special_tokens=False)["input_ids"]
        assert len(encoded) == 1, special
        ids.append(encoded[0])
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id == ids[0]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    # Special tokens inside text are recognised and decode back verbatim.
    text = "<|im_start|>user\n1+1=<|im_end|>\n"
    enc = tok(text, add_special_tokens=False)["input_ids"]
    assert len(enc) == 1 + len("user\n1+1=") + 1 + 1
    assert tok.decode(enc) == text
    assert tok.decode(enc, skip_special_tokens=True) == "user\n1+1=\n"


def test_chat_template_renders_chatml_exactly(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "\\boxed{4}"},
        {"role": "tool", "content": "ok"},
        {"role": "environment", "content": "correct"},
    ]
    assert tok.chat_template == CHATML_TEMPLATE
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2=<|im_end|>\n"
        "<|im_start|>assistant\n\\boxed{4}<|im_end|>\n"
        "<|im_start|>tool\nok<|im_end|>\n"
        "<|im_start|>environment\ncorrect<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages, tokenize=False) == expected
    assert (
        tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
        == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    )  # no default system prompt injected


def test_chat_template_rejects_unknown_role(tok):
    with pytest.raises(Exception, match="unsupported chat role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_tokenizer_save_load_identical(tok, tmp_path):
    build_char_tokenizer(save_dir=tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert loaded.get_vocab() == tok.get_vocab()
    assert loaded.chat_template == CHATML_TEMPLATE
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.unk_token_id, loaded.bos_token_id) == (
        tok.eos_token_id,
        tok.pad_token_id,
        tok.unk_token_id,
        None,
    )
    for text in TRICKY + ["<|im_start|>x<|im_end|>"]:
        ids = loaded(text)["input_ids"]
        assert ids == tok(text)["input_ids"]
        assert loaded.decode(ids) == text
    msgs = [{"role": "user", "content": "7*8="}]
    assert loaded.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


def test_tiny_llama_config(tok):
    model = build_tiny_llama(tok)
    cfg = model.config
    assert cfg.vocab_size == len(tok)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size) == (
        128,
        4,
        4,
        512,
    )
    assert cfg.max_position_embeddings == 256
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert (cfg.eos_token_id, cfg.pad_token_id) == (eos, tok.pad_token_id)
    assert cfg.bos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    gen = model.generation_config
    assert (gen.eos_token_id, gen.pad_token_id) == (eos, tok.pad_token_id)
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.9e6 < n_params < 1.2e6


def test_tiny_llama_deterministic_by_seed_and_keeps_global_rng(tok):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=7)
    c = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


def test_tiny_llama_save_load_same_logits(tok, tmp_path):
    model = build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=4, save_dir=tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert loaded.dtype == torch.float32
    ids = torch.tensor([tok("<|im_start|>user\n12+34=<|im_end|>\n", add_special_tokens=False)["input_ids"]])
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded.generation_config.eos_token_id == tok.eos_token_id
    # The model folder is self-contained: the tokenizer loads from the same path.
    assert AutoTokenizer.from_pretrained(tmp_path / "m").get_vocab() == tok.get_vocab()


def test_tiny_llama_bad_sizes(tok):
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_llama(tok, hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="positive"):
        build_tiny_llama(tok, num_layers=0)


def test_extra_tokens_are_single_ordinary_tokens():
    from nemo_like.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer(extra_tokens=["<tool_call>", "</tool_call>"])
    text = '<tool_call>{"a":1}</tool_call><|im_end|>'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1 + len('{"a":1}') + 1 + 1
    # unlike special tokens they survive skip_special_tokens (the tool parser needs them)
    assert tok.decode(ids, skip_special_tokens=True) == '<tool_call>{"a":1}</tool_call>'
    assert len(build_char_tokenizer()) + 2 == len(tok)
