"""The policy's tokenizer as the driver renders prompts with it: padding set, and the chat template that
``policy.chat_template`` names (the tokenizer's own, one given in the config, or none: raw text)."""

from __future__ import annotations

from typing import Any

from nemo_like.data.chat_templates import apply_chat_template_setting

__all__ = ["load_tokenizer"]


def load_tokenizer(name: str, *, chat_template: str | None = "default", trust_remote_code: bool = False,
                   key: str = "policy.chat_template") -> Any:
    """``AutoTokenizer.from_pretrained(name)`` with a pad token (eos when it has none: padded positions
    are masked by length everywhere) and the template ``chat_template`` resolves to. ValueError naming
    ``key`` when the template is missing or unreadable."""
    from transformers import AutoTokenizer  # transformers is slow to import; config checks must not pay it

    tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return apply_chat_template_setting(tok, chat_template, key=key)
