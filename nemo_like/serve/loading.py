"""Loading a saved model into a :class:`~nemo_like.serve.engines.LocalEngine` for serving."""

from __future__ import annotations

import torch

from nemo_like.models.generation.interfaces import GenerationConfig
from nemo_like.models.pretrained import resolve_model_source
from nemo_like.models.tokenizers import load_tokenizer
from nemo_like.serve.engines import LocalEngine


def load_engine(model: str, *, chat_template: str | None = "default", max_model_len: int | None = None,
                max_num_seqs: int = 32, threads: int | None = None, trust_remote_code: bool = False,
                decode_mode: str = "dynamic") -> LocalEngine:
    """``model`` (what ``policy.model_name`` takes) on this machine's device, ready to serve."""
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    source = resolve_model_source(model, key="--model")
    tokenizer = load_tokenizer(source, chat_template=chat_template, trust_remote_code=trust_remote_code,
                               key="--chat-template")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lm = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code)
    lm.to(device).eval().requires_grad_(False)
    limit = getattr(lm.config, "max_position_embeddings", None) or 4096
    context = min(max_model_len or min(limit, 4096), limit)
    cfg = GenerationConfig(max_new_tokens=context, temperature=1.0, decode_mode=decode_mode)
    return LocalEngine(lm, tokenizer, cfg, context_length=context, slots=max_num_seqs, device=device)
