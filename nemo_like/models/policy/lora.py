"""LoRA on the policy (``policy.lora``) through peft: adapters on the worker's model, their checkpoints
and the export of a merged plain HF model.

Only the adapters train; the base weights stay frozen and bit-identical, so the model with its
adapter disabled *is* the reference policy (no second copy of the weights). A checkpoint holds the
adapter only, as a peft adapter folder (``adapter_config.json``, ``adapter_model.safetensors``), plus
``lora.json``: the base it was trained on (``policy.model_name`` and a fingerprint of its weights)
and the ``policy.lora`` recipe. Loading is exact or refused: every adapter tensor and nothing else,
the same recipe, the same base weights.

peft is imported inside the functions: the driver imports the worker module to build the Ray actors
and never needs peft itself.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_like.models.policy.interfaces import LoraConfig, PolicyConfig

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
LORA_INFO = "lora.json"
# The recipe keys that shape or scale the adapter's tensors; dropout may change on resume.
_RECIPE_KEYS = ("rank", "alpha", "target_modules")
# Fingerprints are float64 sums over float32 weights; summing shards (FSDP) instead of whole
# tensors changes them by ~1e-16 relative, a different base by far more than this.
_FINGERPRINT_RTOL = 1e-9


def hf_model(model):
    """The transformers model inside a peft wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _linear_module_names(model) -> list[str]:
    # transformers' Conv1D (GPT-2 style) is the other layer peft adapts as a linear one.
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if name and (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")})


def check_targets(model, cfg: LoraConfig, model_name: str, key: str = "policy.lora") -> None:
    """Every listed target names a module of the model. peft itself only refuses a list none of
    whose names match; a typo beside correct names would silently leave that module unadapted."""
    if cfg.target_modules == "all-linear":
        return
    modules = [(name, m) for name, m in model.named_modules() if name]
    matched = {t: [m for n, m in modules if n == t or n.endswith(f".{t}")] for t in cfg.target_modules}
    if missing := [t for t, ms in matched.items() if not ms]:
        raise ValueError(f"{key}.target_modules: {missing} not found in {model_name}; its linear modules "
                         f"are {_linear_module_names(model)} (or use target_modules: all-linear)")
    # peft would name the block and print it whole; a block's layers are what can be adapted.
    if blocks := [t for t, ms in matched.items() if all(next(m.children(), None) is not None for m in ms)]:
        raise ValueError(f"{key}.target_modules: {blocks} name blocks of {model_name}, not layers; name "
                         f"its linear modules instead: {_linear_module_names(model)} (or all-linear)")


def apply_lora(model, cfg: LoraConfig, model_name: str, key: str = "policy.lora", task_type: str = "CAUSAL_LM"):
    """``model`` with adapters on ``cfg.target_modules`` and every base weight frozen. ``task_type``
    "SEQ_CLS" (a reward model) also trains the new classification head whole (peft's modules_to_save)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    check_targets(model, cfg, model_name, key)
    targets = cfg.target_modules if cfg.target_modules == "all-linear" else list(cfg.target_modules)
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                              bias="none", task_type=task_type)
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as e:  # e.g. a target that is a block (self_attn), not a layer peft can adapt
        raise ValueError(f"{key}.target_modules={cfg.target_modules!r} on {model_name}: {e}; its linear "
                         f"modules are {_linear_module_names(model)}") from None


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def base_fingerprint(model) -> dict[str, list[float]]:
    """Per frozen tensor: float64 sums of |w| and w^2, over the whole tensor (FSDP shards summed
    over ranks, so every rank calls this together). Cheap next to loading the weights, and enough
    to tell that a checkpoint's adapter is put on the base it was trained on."""
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    if not frozen:
        return {}
    sums = []
    for _, p in frozen:
        t = (p.to_local() if hasattr(p, "to_local") else p).detach().double()
        sums += [t.abs().sum(), (t * t).sum()]
    vec = torch.stack(sums)
    if hasattr(frozen[0][1], "to_local") and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(vec)
    vals = vec.cpu().tolist()
    return {n: vals[2 * i: 2 * i + 2] for i, (n, _) in enumerate(frozen)}


def _check_base(saved: dict[str, list[float]], now: dict[str, list[float]], where: str, saved_name: str,
                model_name: str) -> None:
    differ = sorted(set(saved) ^ set(now)) or sorted(
        n for n in saved if not all(math.isclose(a, b, rel_tol=_FINGERPRINT_RTOL) for a, b in zip(saved[n], now[n])))
    if differ:
        raise RuntimeError(f"{where}: the adapter was trained on other base weights ({saved_name}) than "
                           f"policy.model_name={model_name} holds now; they differ in {differ[:5]}"
                           f"{' ...' if len(differ) > 5 else ''}")


def adapter_file_keys(model) -> dict[str, str]:
    """Key in a peft adapter file -> name of the model's parameter, for every trainable parameter.
    The mapping is peft's own (its public state-dict function on a marker per parameter), the same
    one ``save_pretrained`` writes with."""
    from peft import get_peft_model_state_dict

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    markers = {n: torch.tensor([i]) for i, n in enumerate(names)}
    out = {k: names[int(v)] for k, v in get_peft_model_state_dict(model, state_dict=markers,
                                                                  save_embedding_layers=False).items()}
    if left := sorted(set(names) - set(out.values())):
        # A trainable tensor peft would not save would come back from a checkpoint as initialised.
        raise RuntimeError(f"peft does not save these trainable parameters: {left[:10]}")
    return out


def _adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """The trainable (adapter) tensors, whole, on CPU; a collective under FSDP (same order on every
    rank). Gathered one by one: torch's ``ignore_frozen_params`` keeps a tied frozen weight such as
    ``lm_head`` and would gather the whole embedding for nothing."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            t = p.detach()
            out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu()
    return out


def save_adapter(model, cfg: PolicyConfig, out: Path, rank: int, fingerprint: dict[str, list[float]]) -> None:
    """The adapter as a peft folder plus ``lora.json``; every rank calls this, rank 0 writes."""
    sd = _adapter_state_dict(model)
    if rank != 0:
        return
    model.save_pretrained(out, state_dict=sd, safe_serialization=True, save_embedding_layers=False)
    info = {"model_name": cfg.model_name, "lora": cfg.lora.model_dump(), "base_fingerprint": fingerprint}
    (out / LORA_INFO).write_text(json.dumps(info, indent=1))


def refuse_adapter_checkpoint(path: Path) -> None:
    """A policy without LoRA asked to load a LoRA checkpoint: say so rather than list every missing tensor."""
    if (path / LORA_INFO).exists() or (path / ADAPTER_CONFIG).exists():
        raise RuntimeError(f"{path} holds a LoRA adapter (saved with policy.lora.enabled: true), not full weights: "
                           "load it with the same policy.lora settings, or export a merged model "
                           "(examples/export_model.py) and use that folder as policy.model_name")


def load_adapter(model, cfg: PolicyConfig, path: Path, fingerprint: dict[str, list[float]]) -> None:
    """Exact or refused: the same recipe, the same base weights, every adapter tensor and nothing else."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not (path / LORA_INFO).exists() or not (path / ADAPTER_FILE).exists():
        raise RuntimeError(f"{path}: no LoRA adapter ({LORA_INFO}, {ADAPTER_FILE}) in this checkpoint; it was saved "
                           "with policy.lora.enabled false. To train an adapter on top of those weights, use the "
                           "folder as policy.model_name")
    info = json.loads((path / LORA_INFO).read_text())
    now = cfg.lora.model_dump()
    if differ := [k for k in _RECIPE_KEYS if info["lora"].get(k) != now[k]]:
        raise RuntimeError(f"{path}: the adapter was trained with " + ", ".join(
            f"policy.lora.{k}={info['lora'].get(k)!r}" for k in differ) + "; this policy has " + ", ".join(
            f"{k}={now[k]!r}" for k in differ))
    _check_base(info["base_fingerprint"], fingerprint, str(path), info["model_name"], cfg.model_name)
    sd = load_file(str(path / ADAPTER_FILE))
    names = adapter_file_keys(model)
    missing, unexpected = sorted(set(names) - set(sd)), sorted(set(sd) - set(names))
    if missing or unexpected:
        raise RuntimeError(f"{path}: the checkpoint's adapter does not match the model: missing {missing[:10]}"
                           f"{' ...' if len(missing) > 10 else ''}, unexpected {unexpected[:10]}"
                           f"{' ...' if len(unexpected) > 10 else ''}")
    # With whole tensors, the frozen weights absent from the dict keep their values (torch fills
    # them from the model); which tensors are present was checked above.
    set_model_state_dict(model, {names[k]: v for k, v in sd.items()},
                         options=StateDictOptions(full_state_dict=True, strict=True))


def export_merged_model(model, cfg: PolicyConfig, out: Path, rank: int, fingerprint: dict[str, list[float]]) -> None:
    """A plain HF model (float32, the master weights' precision) with the adapter merged into the
    base weights. The training model's base must stay bit-identical, so the merge happens on a fresh
    copy of the base on rank 0, checked against the fingerprint of the one trained on."""
    from transformers import AutoModelForCausalLM

    sd = _adapter_state_dict(model)
    if rank != 0:
        return
    base = AutoModelForCausalLM.from_pretrained(cfg.model_name, dtype=torch.float32,
                                                trust_remote_code=cfg.trust_remote_code)
    fresh = apply_lora(base, cfg.lora, cfg.model_name)
    _check_base(fingerprint, base_fingerprint(fresh), f"export to {out}", cfg.model_name, cfg.model_name)
    trainable = {n for n, p in fresh.named_parameters() if p.requires_grad}
    if set(sd) != trainable:
        raise RuntimeError(f"export to {out}: the adapter does not fit a fresh copy of the model: missing "
                           f"{sorted(trainable - set(sd))[:10]}, unexpected {sorted(set(sd) - trainable)[:10]}")
    fresh.load_state_dict(sd, strict=False)  # the frozen base tensors are the ones just read
    merged = fresh.merge_and_unload(safe_merge=True)
    merged.save_pretrained(out, safe_serialization=True)
