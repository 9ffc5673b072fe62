"""A tiny character-level tokenizer and Llama model, built locally (no hub access needed).

Both are saved as ordinary Hugging Face folders, so everything downstream loads them by path exactly as
it would load a hub model such as ``Qwen/Qwen2.5-1.5B``.
"""

from __future__ import annotations

import os
import string
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from nemo_like.data.chat_templates import CHATML_TEMPLATE

PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
ENDOFTEXT_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, UNK_TOKEN, ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN]

# string.printable = digits, letters, punctuation and whitespace (" \t\n\r\x0b\x0c"): every printable
# ASCII character is one token, including space, newline, backslash and braces (needed for \boxed{}).
CHARACTERS = list(dict.fromkeys(string.printable))


def build_char_tokenizer(save_dir: str | os.PathLike | None = None,
                         extra_tokens: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """Build a character-level tokenizer with a ChatML chat template.

    Special tokens (each a single id): ``<|pad|>`` (pad), ``<|unk|>`` (unknown characters),
    ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (eos). There is no BOS token, so
    ``tokenizer(text)`` encodes exactly the characters of ``text``. ``decode(encode(s)) == s`` for any
    string made of printable ASCII characters. ``extra_tokens`` (e.g. ``"<tool_call>"``) become single
    ordinary tokens: they survive ``decode(..., skip_special_tokens=True)``, as in Qwen's tokenizer.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # No normalizer: text must round-trip byte for byte. "[\s\S]" isolates every character, newlines too.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates the token strings; the default decoder would join them with spaces.
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        eos_token=IM_END_TOKEN,
        bos_token=None,
        additional_special_tokens=[ENDOFTEXT_TOKEN, IM_START_TOKEN],
        clean_up_tokenization_spaces=False,
        padding_side="right",
        model_max_length=1_000_000,
    )
    if extra_tokens:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra_tokens])
    tokenizer.chat_template = CHATML_TEMPLATE
    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def build_tiny_llama(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
    save_dir: str | os.PathLike | None = None,
) -> LlamaForCausalLM:
    """A randomly initialised ``LlamaForCausalLM`` sized for ``tokenizer``; the same seed gives the same weights.

    ``intermediate_size`` defaults to ``4 * hidden_size`` (about 1M parameters with the defaults).
    If ``save_dir`` is given, the model (and the tokenizer, so the folder is self-contained) are saved there.
    """
    if hidden_size <= 0 or num_layers <= 0 or num_heads <= 0 or max_position_embeddings <= 0:
        raise ValueError(
            f"hidden_size, num_layers, num_heads and max_position_embeddings must be positive, got "
            f"{hidden_size}, {num_layers}, {num_heads}, {max_position_embeddings}"
        )
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
    if intermediate_size is None:
        intermediate_size = 4 * hidden_size
    pad_id = tokenizer.pad_token_id
    eos_id = tokenizer.convert_tokens_to_ids(IM_END_TOKEN)
    bos_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT_TOKEN)
    if pad_id is None or eos_id is None or eos_id == tokenizer.unk_token_id:
        raise ValueError("the tokenizer needs a pad token and an <|im_end|> token (use build_char_tokenizer)")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=bos_id,
    )
    # Seed a forked RNG so building a model neither depends on nor disturbs the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=bos_id
    )
    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(save_dir))
        tokenizer.save_pretrained(str(save_dir))
    return model
