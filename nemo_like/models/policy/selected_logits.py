"""Log-probs computed only where a loss reads them: the output layer applied to those positions alone.

Every loss here reads a sample's log-probs where its ``token_mask`` is 1 (the completion's tokens), yet
the output layer and the [positions, vocabulary] fp32 tensors after it (log-sum-exp, its gradient)
were computed at every position, prompts included. With a real vocabulary (SmolLM2: 49,152) and
prompts longer than the completions that was about 40% of a training pass on a CPU
(docs/performance.md, "Log-probs where the loss reads them"). Positions outside the mask get log-prob 0, as position 0
always did.

The model still runs its own forward (FSDP's hooks, LoRA, a model's logit scaling or soft-capping
all apply); a pre-hook on its output layer hands it only the hidden states of the positions wanted,
so its logits come back as [N, vocabulary].
"""

from __future__ import annotations

from typing import Any

import torch


class SelectionError(RuntimeError):
    """The model's forward did not return logits for the selected positions only."""


def output_layer(model: Any) -> torch.nn.Module | None:
    """The module that turns hidden states into logits, or None when the model does not say."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None


def logits_at(model: Any, flat: torch.Tensor, **inputs: Any) -> torch.Tensor:
    """[N, V] logits of ``model(**inputs)`` at ``flat`` (N indices into its [rows * width] positions)."""
    head = output_layer(model)
    if head is None:
        raise SelectionError("the model has no output layer to select positions for")

    def keep(_module: Any, args: tuple) -> tuple:
        h = args[0]
        return (h.reshape(-1, h.shape[-1]).index_select(0, flat.to(h.device)), *args[1:])

    handle = head.register_forward_pre_hook(keep)
    try:
        logits = model(**inputs, use_cache=False).logits
    finally:
        handle.remove()
    if logits.dim() != 2 or logits.shape[0] != flat.numel():
        raise SelectionError(f"the model's forward reshaped the selected logits to {tuple(logits.shape)}")
    return logits


# Set on a model whose forward would not hand back the selected positions' logits: computed whole.
_REFUSED = "_nemo_like_no_selected_logits"


def can_select(model: Any) -> bool:
    """Whether ``model``'s log-probs can be computed at selected positions only."""
    return output_layer(model) is not None and not getattr(model, _REFUSED, False)


def try_selected(model: Any, inputs: dict[str, Any], flat_pos: torch.Tensor, targets: torch.Tensor,
                 need: torch.Tensor, temperature: float, topk: int | torch.Tensor | None = None):
    """``selected_logprobs``, or None (and never again for this model) when its forward does not allow it."""
    try:
        return selected_logprobs(model, inputs, flat_pos, targets, need, temperature, topk)
    except SelectionError:
        object.__setattr__(model, _REFUSED, True)
        return None


def selected_logprobs(model: Any, inputs: dict[str, Any], flat_pos: torch.Tensor, targets: torch.Tensor,
                      need: torch.Tensor, temperature: float, topk: int | torch.Tensor | None = None):
    """``token_logprobs``' results ([b, T] log-probs; with ``topk`` the top-k parts [b, T, k]) computed
    where ``need`` [b, T] is True and 0 elsewhere. ``flat_pos`` [b, T]: the position of the forward's
    [rows * width] hidden states that predicts token t of sample i; ``targets`` [b, T]: that token.
    A position shared by several samples (a packed group's prompt) is computed once."""
    sel = need.nonzero(as_tuple=True)
    keep, inv = torch.unique(flat_pos[sel], return_inverse=True)
    logits = logits_at(model, keep, **inputs).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    dev = logits.device
    sel = tuple(s.to(dev) for s in sel)
    inv = inv.to(dev)
    picked = logits[inv, targets.to(dev)[sel]] - lse[inv]
    b, T = need.shape
    lp = torch.zeros(b, T, dtype=picked.dtype, device=dev).index_put(sel, picked)
    if topk is None:
        return lp
    if isinstance(topk, int):
        vals, ids = logits.topk(topk, dim=-1)
        top_ids = torch.zeros(b, T, topk, dtype=ids.dtype, device=dev).index_put(sel, ids[inv])
        top_lp = torch.zeros(b, T, topk, dtype=vals.dtype, device=dev).index_put(sel, vals[inv] - lse[inv, None])
        return lp, top_ids, top_lp
    ids = topk.to(dev)[sel]  # [M, k]
    got = logits[inv[:, None], ids] - lse[inv, None]
    return lp, torch.zeros(b, T, ids.shape[-1], dtype=got.dtype, device=dev).index_put(sel, got)
