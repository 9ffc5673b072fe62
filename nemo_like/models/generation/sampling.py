"""Choosing the next token from a row's logits, and the log-prob the trainer will recompute for it."""

from __future__ import annotations

import torch

from nemo_like.models.generation.interfaces import GenerationConfig


def sample(logits: torch.Tensor, greedy: bool, cfg: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens and their log-probs under the temperature-scaled distribution (what the training side
    recomputes; top-p/top-k truncation is not renormalised in), as `hf_generate` defines them."""
    logits = logits.float()
    if greedy:
        tok = logits.argmax(-1)
        return tok, logits.log_softmax(-1).gather(1, tok[:, None]).squeeze(1)
    scores = logits / cfg.temperature
    logp = scores.log_softmax(-1)
    # The same warpers, in the same order, as HF's sampling: top-k, then top-p (keeping at least one).
    if cfg.top_k:
        kth = torch.topk(scores, min(cfg.top_k, scores.shape[-1]))[0][:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        drop = sorted_scores.softmax(-1).cumsum(-1) <= 1 - cfg.top_p
        drop[:, -1] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    tok = torch.multinomial(scores.softmax(-1), 1).squeeze(1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 cfg: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` with a temperature and a top-p per row ([B] each), for a server's requests that
    ask for their own (top-k stays the engine's)."""
    scores = logits.float() / temperature[:, None]
    logp = scores.log_softmax(-1)
    if cfg.top_k:
        kth = torch.topk(scores, min(cfg.top_k, scores.shape[-1]))[0][:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    sorted_scores, order = torch.sort(scores, descending=False)
    drop = sorted_scores.softmax(-1).cumsum(-1) <= (1 - top_p)[:, None]
    drop[:, -1] = False
    scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    tok = torch.multinomial(scores.softmax(-1), 1).squeeze(1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)
