"""What the Megatron-core backend reads from an HF config: the dimensions of a supported Llama-shaped
decoder (``model_type`` llama, qwen2 or qwen3), or a ``ValueError`` naming the first field it cannot
map, its value and what is supported. Plain Python (no torch, no megatron import): the config check
runs before anything is built or loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelDims:
    """What the mapping needs to know of a supported HF config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    initializer_range: float

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _cfg(hf_config: Any, name: str, default: Any = None) -> Any:
    if isinstance(hf_config, dict):
        return hf_config.get(name, default)
    return getattr(hf_config, name, default)


def _refuse(field: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"Megatron backend: unsupported HF config {field}={value!r}; supported: {supported}")


def _rope(hf_config: Any) -> float:
    """``rope_theta`` of plain (unscaled) rotary embeddings; refuses any scaling. transformers 5 keeps
    them in ``rope_parameters`` (``rope_scaling`` reads the same dict), 4.x in ``rope_theta`` and
    ``rope_scaling``."""
    params = _cfg(hf_config, "rope_parameters")
    scaling = _cfg(hf_config, "rope_scaling")
    for field, d in (("rope_parameters", params), ("rope_scaling", scaling)):
        if d is None:
            continue
        if not isinstance(d, dict):
            raise _refuse(field, d, "None or plain rotary embeddings ({'rope_type': 'default'})")
        kind = d.get("rope_type", d.get("type"))
        if kind not in (None, "default"):
            raise _refuse(field, d, "None or plain rotary embeddings (rope_type 'default'); "
                                    "scaled RoPE (llama3, yarn, linear, dynamic, ...) is not mapped")
        factor = d.get("partial_rotary_factor", 1.0)
        if factor not in (None, 1, 1.0):
            raise _refuse(f"{field}.partial_rotary_factor", factor, "1.0 (rotary on the whole head)")
    theta = (params or {}).get("rope_theta") if isinstance(params, dict) else None
    if theta is None:
        theta = _cfg(hf_config, "rope_theta", 10000.0)
    return float(theta)


def model_dims(hf_config: Any) -> ModelDims:
    """The dimensions of a supported HF config; a ``ValueError`` names the first unsupported field."""
    mt = _cfg(hf_config, "model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise _refuse("model_type", mt, ", ".join(SUPPORTED_MODEL_TYPES) + " (Llama-shaped decoders)")
    act = _cfg(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "'silu' (SwiGLU MLP)")
    if _cfg(hf_config, "mlp_bias", False):
        raise _refuse("mlp_bias", True, "False (MLP without biases)")
    attention_bias = bool(_cfg(hf_config, "attention_bias", False))
    if mt in ("llama", "qwen3") and attention_bias:
        raise _refuse("attention_bias", True, f"False for {mt} (qwen2's q/k/v biases are the only biases mapped)")
    if _cfg(hf_config, "use_sliding_window", False):
        raise _refuse("use_sliding_window", True, "False (full causal attention in every layer)")
    layer_types = _cfg(hf_config, "layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise _refuse("layer_types", sorted(set(layer_types)), "['full_attention'] (no sliding-window layers)")
    if _cfg(hf_config, "pretraining_tp", 1) not in (None, 1):
        raise _refuse("pretraining_tp", _cfg(hf_config, "pretraining_tp"), "1")
    rope_theta = _rope(hf_config)

    hidden = int(_cfg(hf_config, "hidden_size"))
    heads = int(_cfg(hf_config, "num_attention_heads"))
    kv_heads = int(_cfg(hf_config, "num_key_value_heads") or heads)
    head_dim = _cfg(hf_config, "head_dim") or hidden // heads
    if heads % kv_heads:
        raise _refuse("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads ({heads})")
    return ModelDims(
        model_type=mt, num_layers=int(_cfg(hf_config, "num_hidden_layers")), hidden_size=hidden,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=int(head_dim),
        ffn_hidden_size=int(_cfg(hf_config, "intermediate_size")), vocab_size=int(_cfg(hf_config, "vocab_size")),
        max_position_embeddings=int(_cfg(hf_config, "max_position_embeddings", 4096)),
        rms_norm_eps=float(_cfg(hf_config, "rms_norm_eps", 1e-6)), rope_theta=rope_theta,
        tied=bool(_cfg(hf_config, "tie_word_embeddings", False)),
        qkv_bias=mt == "qwen2", qk_norm=mt == "qwen3",
        initializer_range=float(_cfg(hf_config, "initializer_range", 0.02)),
    )
