"""HF Llama-shaped decoders <-> Megatron-core ``GPTModel``: the config translation and the weight mapping.

Supported: ``model_type`` llama, qwen2 and qwen3 (RMSNorm, SwiGLU MLP, rotary embeddings, grouped-query
attention; qwen2's q/k/v biases, qwen3's per-head q/k RMSNorm), tensor and pipeline parallel size 1.
Anything else is refused with a ``ValueError`` naming the field, its value and what is supported.

The Megatron side is the ``GPTModel`` of megatron-core's *local* layer spec (no Transformer Engine, no
apex: plain ``torch.nn.RMSNorm`` norms, ``ColumnParallelLinear``/``RowParallelLinear``,
``DotProductAttention``). Its parameter names (megatron-core 0.16.1), per layer ``L = decoder.layers.<i>``:

====================================================  ====================================================
HF (``AutoModelForCausalLM``)                          Megatron (local spec)
====================================================  ====================================================
``model.embed_tokens.weight``                          ``embedding.word_embeddings.weight``
``model.layers.<i>.input_layernorm.weight``            ``L.input_layernorm.weight``
``...self_attn.{q,k,v}_proj.weight`` (and ``.bias``)   ``L.self_attention.linear_qkv.weight`` (``.bias``)
``...self_attn.o_proj.weight``                         ``L.self_attention.linear_proj.weight``
``...self_attn.{q,k}_norm.weight`` (qwen3)             ``L.self_attention.{q,k}_layernorm.weight``
``model.layers.<i>.post_attention_layernorm.weight``   ``L.pre_mlp_layernorm.weight``
``...mlp.{gate,up}_proj.weight``                       ``L.mlp.linear_fc1.weight`` (``[gate; up]``)
``...mlp.down_proj.weight``                            ``L.mlp.linear_fc2.weight``
``model.norm.weight``                                  ``decoder.final_layernorm.weight``
``lm_head.weight`` (absent when tied)                  ``output_layer.weight`` (absent when tied)
====================================================  ====================================================

The fused QKV is Megatron's per-query-group layout: ``[ng, (q_per_group + 2) * head_dim, hidden]``, for
each of the ``ng`` key/value groups its query heads, then its key head, then its value head (the layout
``SelfAttention.get_query_key_value_tensors`` splits). Megatron's ``*._extra_state`` entries (Transformer
Engine/FP8 metadata, ``None`` here) carry no weights: the mapping ignores them and
:func:`load_megatron_state_dict` fills them from the model itself.

The HF config is read (and an unsupported one refused) by :mod:`megatron_dims`. The weight mapping is
pure torch (no megatron import); :func:`megatron_config_from_hf` and :func:`build_gpt_model` import
megatron-core lazily and name the extra to install when it is missing.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple

import torch

from nemo_like.models.policy.megatron_dims import ModelDims, model_dims

INSTALL_HINT = "pip install 'nemo_like[megatron]'"
_EXTRA_STATE = "_extra_state"


def require_megatron() -> None:
    """Raise an ImportError naming the extra to install when megatron-core is missing."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the Megatron-core policy backend needs megatron-core: {INSTALL_HINT} "
                          f"(or add megatron-core==0.16.1); import failed: {e}") from e


# ---- the Megatron model ---------------------------------------------------------------------------

class MegatronModelConfig(NamedTuple):
    """What builds the ``GPTModel``: its ``TransformerConfig`` and the constructor's other arguments."""

    transformer_config: Any  # megatron.core.transformer.TransformerConfig
    gpt_kwargs: dict[str, Any]


def megatron_config_from_hf(hf_config: Any, *, params_dtype: torch.dtype = torch.float32,
                            use_cpu_initialization: bool = False, perform_initialization: bool = True,
                            **overrides: Any) -> MegatronModelConfig:
    """The megatron ``TransformerConfig`` (tensor/pipeline parallel 1, no dropout, no fused kernels)
    and the ``GPTModel`` keyword arguments of a supported HF config. ``overrides`` are further
    ``TransformerConfig`` fields (e.g. ``recompute_granularity``)."""
    d = model_dims(hf_config)
    require_megatron()
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    if params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params_dtype must be float32, bfloat16 or float16, got {params_dtype}")
    fields: dict[str, Any] = dict(
        num_layers=d.num_layers, hidden_size=d.hidden_size, num_attention_heads=d.num_heads,
        num_query_groups=d.num_kv_heads, kv_channels=d.head_dim, ffn_hidden_size=d.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=d.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=d.qkv_bias,
        qk_layernorm=d.qk_norm, rotary_interleaved=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        # Plain torch code paths: the fused kernels need apex / Transformer Engine / custom CUDA builds.
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        attention_softmax_in_fp32=True, apply_query_key_layer_scaling=False,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype, init_method_std=d.initializer_range,
        use_cpu_initialization=use_cpu_initialization, perform_initialization=perform_initialization,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, sequence_parallel=False,
    )
    fields.update(overrides)
    config = TransformerConfig(**fields)
    gpt_kwargs = dict(
        vocab_size=d.vocab_size, max_sequence_length=d.max_position_embeddings,
        position_embedding_type="rope", rotary_percent=1.0, rotary_base=d.rope_theta,
        share_embeddings_and_output_weights=d.tied, parallel_output=True,
        pre_process=True, post_process=True,
    )
    return MegatronModelConfig(config, gpt_kwargs)


def layer_spec(hf_config: Any):
    """The local (torch-only) transformer block spec of the model: RMSNorm everywhere, the final
    norm included (megatron's default final norm would be apex's or Transformer Engine's when
    either is installed)."""
    require_megatron()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    d = model_dims(hf_config)
    layer = get_gpt_layer_local_spec(qk_layernorm=d.qk_norm, normalization="RMSNorm")
    return TransformerBlockSubmodules(layer_specs=[layer] * d.num_layers, layer_norm=WrappedTorchNorm)


def build_gpt_model(hf_config: Any, *, params_dtype: torch.dtype = torch.float32,
                    use_cpu_initialization: bool = False, perform_initialization: bool = True,
                    **overrides: Any):
    """A ``GPTModel`` shaped like the HF model (random or uninitialised weights: load them with
    :func:`load_megatron_state_dict`). Needs torch.distributed and megatron's model-parallel state
    initialised (:func:`init_model_parallel`). ``use_cpu_initialization``: parameters on the CPU
    (else on ``torch.cuda.current_device()``)."""
    require_megatron()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_gpt_model: megatron's model-parallel state is not initialised; call "
                           "nemo_like.models.policy.megatron_mapping.init_model_parallel() first")
    config, kwargs = megatron_config_from_hf(hf_config, params_dtype=params_dtype,
                                             use_cpu_initialization=use_cpu_initialization,
                                             perform_initialization=perform_initialization, **overrides)
    model = GPTModel(config, layer_spec(hf_config), **kwargs)
    # The torch.nn.RMSNorm norms of the local spec are made in float32 on the CPU whatever the config
    # says (megatron's own training wraps the model in Float16Module, which casts it); the linear
    # layers and the embedding follow params_dtype and use_cpu_initialization already.
    model.to(dtype=params_dtype)
    if not use_cpu_initialization:
        model.cuda(torch.cuda.current_device())
    return model


def init_model_parallel(backend: str = "gloo", *, seed: int | None = None) -> None:
    """One process, tensor/pipeline parallel 1: torch.distributed (``backend``; RANK/WORLD_SIZE/
    MASTER_ADDR/MASTER_PORT from the environment, defaults for a single process) and megatron's
    parallel state, if not done yet. ``seed``: also megatron's CUDA RNG tracker (GPU only)."""
    import os

    import torch.distributed as dist

    require_megatron()
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(free_port())
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group(backend=backend, rank=int(os.environ.get("RANK", "0")),
                                world_size=int(os.environ.get("WORLD_SIZE", "1")))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if seed is not None:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _NoForkRNGTracker:
    def fork(self, *args: Any, **kwargs: Any):
        return contextlib.nullcontext()


class cpu_forward_context:  # noqa: N801 - used as a function-style context manager
    """Run a (local-spec, dropout-free) GPTModel's forward and backward on the CPU, for tests and
    CPU-only runs. Megatron wants CUDA in three places: the rotary table and the attention score
    buffer go to ``torch.cuda.current_device()``, and attention dropout forks the CUDA RNG tracker.
    Inside this context the first answers ``"cpu"`` and the tracker's fork does nothing. Nested or
    overlapping uses (several CPU workers in one process) count: the originals come back when the
    last one exits. Not for use on a GPU, nor from several threads."""

    _depth = 0
    _saved: tuple | None = None

    def __enter__(self) -> cpu_forward_context:
        require_megatron()
        from megatron.core import tensor_parallel

        cls = type(self)
        if cls._depth == 0:
            cls._saved = (torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker)
            torch.cuda.current_device = lambda: "cpu"
            tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: _NoForkRNGTracker()
        cls._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        from megatron.core import tensor_parallel

        cls = type(self)
        cls._depth -= 1
        if cls._depth == 0 and cls._saved is not None:
            torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker = cls._saved
            cls._saved = None


def causal_attention_mask(seq_len: int, device: torch.device | str) -> torch.Tensor:
    """The mask ``GPTModel.forward`` takes for causal attention: ``[1, 1, s, s]`` bool, True where a
    position may NOT attend (later positions). Right padding needs nothing more: a real token never
    attends to the pads after it. (With ``attention_mask=None`` megatron builds the same mask, on
    ``"cuda"``.)"""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


# ---- the weights --------------------------------------------------------------------------------

def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def _mc_layer(i: int) -> str:
    return f"decoder.layers.{i}."


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: ModelDims) -> torch.Tensor:
    """[nh*hd, ...], [ng*hd, ...], [ng*hd, ...] -> [ng*(q_per_group+2)*hd, ...] (per-group q, k, v)."""
    ng, hd = d.num_kv_heads, d.head_dim
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(ng, d.q_per_group * hd, *rest), k.reshape(ng, hd, *rest),
                       v.reshape(ng, hd, *rest)], dim=1)
    return fused.reshape(ng * (d.q_per_group + 2) * hd, *rest)


def _split_qkv(t: torch.Tensor, d: ModelDims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, hd = d.num_kv_heads, d.head_dim
    rest = t.shape[1:]
    expected = ng * (d.q_per_group + 2) * hd
    if t.shape[0] != expected:
        raise ValueError(f"fused QKV has {t.shape[0]} rows, expected {expected} "
                         f"({ng} groups x ({d.q_per_group} + 2) heads x {hd})")
    g = t.reshape(ng, (d.q_per_group + 2) * hd, *rest)
    q, k, v = torch.split(g, [d.q_per_group * hd, hd, hd], dim=1)
    return (q.reshape(ng * d.q_per_group * hd, *rest).contiguous(), k.reshape(ng * hd, *rest).contiguous(),
            v.reshape(ng * hd, *rest).contiguous())


def _take(sd: dict[str, torch.Tensor], used: set[str], key: str, side: str) -> torch.Tensor:
    if key not in sd:
        raise KeyError(f"{side} state dict has no {key!r}")
    used.add(key)
    return sd[key]


def _check_all_used(sd: dict[str, Any], used: set[str], side: str, ignore=lambda k: False) -> None:
    left = sorted(k for k in sd if k not in used and not ignore(k))
    if left:
        raise ValueError(f"{side} state dict has tensors the mapping does not know: {left[:10]}"
                         f"{' ...' if len(left) > 10 else ''}")


def hf_to_megatron_state_dict(hf_sd: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """An HF state dict (``model.state_dict()`` names) as the local-spec ``GPTModel``'s state dict
    (no ``_extra_state``; tensors keep their dtype and device). Tied models: ``lm_head.weight`` may be
    present (it is the embedding) and is dropped. Unknown keys are refused."""
    d = model_dims(hf_config)
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": _take(hf_sd, used, "model.embed_tokens.weight", "HF"),
        "decoder.final_layernorm.weight": _take(hf_sd, used, "model.norm.weight", "HF"),
    }
    if d.tied:
        if "lm_head.weight" in hf_sd:
            used.add("lm_head.weight")
            lm, emb = hf_sd["lm_head.weight"], hf_sd["model.embed_tokens.weight"]
            if lm.data_ptr() != emb.data_ptr() and not torch.equal(lm, emb):
                raise ValueError("tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
    else:
        out["output_layer.weight"] = _take(hf_sd, used, "lm_head.weight", "HF")
    for i in range(d.num_layers):
        h, m = _hf_layer(i), _mc_layer(i)

        def hf(name: str, h=h) -> torch.Tensor:
            return _take(hf_sd, used, h + name, "HF")

        out[m + "input_layernorm.weight"] = hf("input_layernorm.weight")
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            hf("self_attn.q_proj.weight"), hf("self_attn.k_proj.weight"), hf("self_attn.v_proj.weight"), d)
        if d.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                hf("self_attn.q_proj.bias"), hf("self_attn.k_proj.bias"), hf("self_attn.v_proj.bias"), d)
        out[m + "self_attention.linear_proj.weight"] = hf("self_attn.o_proj.weight")
        if d.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf("self_attn.q_norm.weight")
            out[m + "self_attention.k_layernorm.weight"] = hf("self_attn.k_norm.weight")
        out[m + "pre_mlp_layernorm.weight"] = hf("post_attention_layernorm.weight")
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf("mlp.gate_proj.weight"), hf("mlp.up_proj.weight")], dim=0)
        out[m + "mlp.linear_fc2.weight"] = hf("mlp.down_proj.weight")
    _check_all_used(hf_sd, used, "HF")
    return out


def megatron_to_hf_state_dict(mcore_sd: dict[str, Any], hf_config: Any, *,
                              with_tied_lm_head: bool = False) -> dict[str, torch.Tensor]:
    """The local-spec ``GPTModel``'s state dict (``_extra_state`` entries ignored) as HF names.
    Tied models: ``lm_head.weight`` only with ``with_tied_lm_head`` (the embedding tensor itself, as
    ``model.state_dict()`` lists it; ``named_parameters`` and ``save_pretrained`` name it once)."""
    d = model_dims(hf_config)
    used: set[str] = set()

    def mc(key: str) -> torch.Tensor:
        return _take(mcore_sd, used, key, "Megatron")

    emb = mc("embedding.word_embeddings.weight")
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": emb}
    for i in range(d.num_layers):
        h, m = _hf_layer(i), _mc_layer(i)
        q, k, v = _split_qkv(mc(m + "self_attention.linear_qkv.weight"), d)
        if d.qkv_bias:
            qb, kb, vb = _split_qkv(mc(m + "self_attention.linear_qkv.bias"), d)
            out |= {h + "self_attn.q_proj.weight": q, h + "self_attn.q_proj.bias": qb,
                    h + "self_attn.k_proj.weight": k, h + "self_attn.k_proj.bias": kb,
                    h + "self_attn.v_proj.weight": v, h + "self_attn.v_proj.bias": vb}
        else:
            out |= {h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k,
                    h + "self_attn.v_proj.weight": v}
        out[h + "self_attn.o_proj.weight"] = mc(m + "self_attention.linear_proj.weight")
        if d.qk_norm:
            out[h + "self_attn.q_norm.weight"] = mc(m + "self_attention.q_layernorm.weight")
            out[h + "self_attn.k_norm.weight"] = mc(m + "self_attention.k_layernorm.weight")
        fc1 = mc(m + "mlp.linear_fc1.weight")
        if fc1.shape[0] != 2 * d.ffn_hidden_size:
            raise ValueError(f"{m}mlp.linear_fc1.weight has {fc1.shape[0]} rows, expected 2 x {d.ffn_hidden_size}")
        gate, up = torch.chunk(fc1, 2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
        out[h + "mlp.down_proj.weight"] = mc(m + "mlp.linear_fc2.weight")
        out[h + "input_layernorm.weight"] = mc(m + "input_layernorm.weight")
        out[h + "post_attention_layernorm.weight"] = mc(m + "pre_mlp_layernorm.weight")
    out["model.norm.weight"] = mc("decoder.final_layernorm.weight")
    if not d.tied:
        out["lm_head.weight"] = mc("output_layer.weight")
    elif with_tied_lm_head:
        out["lm_head.weight"] = emb
    _check_all_used(mcore_sd, used, "Megatron", ignore=lambda k: k.endswith(_EXTRA_STATE))
    return out


def hf_parameter_names(hf_config: Any) -> list[str]:
    """The HF parameter names of the model, as ``named_parameters`` lists them (tied weights once),
    in the order :func:`megatron_to_hf_state_dict` yields them."""
    d = model_dims(hf_config)
    names = ["model.embed_tokens.weight"]
    for i in range(d.num_layers):
        h = _hf_layer(i)
        for p in "qkv":
            names.append(h + f"self_attn.{p}_proj.weight")
            if d.qkv_bias:
                names.append(h + f"self_attn.{p}_proj.bias")
        names.append(h + "self_attn.o_proj.weight")
        if d.qk_norm:
            names += [h + "self_attn.q_norm.weight", h + "self_attn.k_norm.weight"]
        names += [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight", h + "mlp.down_proj.weight",
                  h + "input_layernorm.weight", h + "post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not d.tied:
        names.append("lm_head.weight")
    return names


def hf_parameter_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, computed from the config alone (no weights)."""
    d = model_dims(hf_config)
    H, hd = d.hidden_size, d.head_dim
    shapes = {}
    for name in hf_parameter_names(hf_config):
        leaf = name.split(".")[-2] if name.endswith((".weight", ".bias")) else name
        bias = name.endswith(".bias")
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            s: tuple[int, ...] = (d.vocab_size, H)
        elif leaf in ("input_layernorm", "post_attention_layernorm", "norm"):
            s = (H,)
        elif leaf in ("q_norm", "k_norm"):
            s = (hd,)
        elif leaf == "q_proj":
            s = (d.num_heads * hd,) if bias else (d.num_heads * hd, H)
        elif leaf in ("k_proj", "v_proj"):
            s = (d.num_kv_heads * hd,) if bias else (d.num_kv_heads * hd, H)
        elif leaf == "o_proj":
            s = (H, d.num_heads * hd)
        elif leaf in ("gate_proj", "up_proj"):
            s = (d.ffn_hidden_size, H)
        elif leaf == "down_proj":
            s = (H, d.ffn_hidden_size)
        else:  # pragma: no cover - hf_parameter_names yields only the above
            raise AssertionError(name)
        shapes[name] = s
    return shapes


def load_megatron_state_dict(model: torch.nn.Module, mcore_sd: dict[str, torch.Tensor]) -> None:
    """``model.load_state_dict(strict=True)`` with the model's own ``_extra_state`` entries filled in
    (the mapped dict has none); the error of a mismatch names the missing and unexpected keys."""
    own = model.state_dict()
    full = dict(mcore_sd)
    for k, v in own.items():
        if k.endswith(_EXTRA_STATE) and k not in full:
            full[k] = v
    missing = sorted(set(own) - set(full))
    unexpected = sorted(set(full) - set(own))
    if missing or unexpected:
        raise RuntimeError(f"Megatron state dict does not match the GPTModel: missing {missing[:10]}, "
                           f"unexpected {unexpected[:10]}")
    bad = [(k, tuple(full[k].shape), tuple(own[k].shape)) for k in own
           if not k.endswith(_EXTRA_STATE) and tuple(full[k].shape) != tuple(own[k].shape)]
    if bad:
        raise RuntimeError(f"Megatron state dict shapes differ from the GPTModel's (key, given, model): {bad[:10]}")
    model.load_state_dict(full, strict=True)


def megatron_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors without ``_extra_state`` entries (detached, same device)."""
    return {k: v.detach() for k, v in model.state_dict().items()
            if not k.endswith(_EXTRA_STATE) and isinstance(v, torch.Tensor)}


def gpt_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s, vocab]`` logits of right-padded ``input_ids`` ``[b, s]`` (causal; positions 0..s-1)."""
    b, s = input_ids.shape
    position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    return model(input_ids=input_ids, position_ids=position_ids,
                 attention_mask=causal_attention_mask(s, input_ids.device))


def token_logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logprobs[:, t] = log p(input_ids[:, t] | < t); position 0 is 0 (as the HF worker's)."""
    lg = logits[:, :-1].float()
    if temperature != 1.0:
        lg = lg / temperature
    picked = torch.gather(lg, 2, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    lp = picked - torch.logsumexp(lg, dim=-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def num_parameters(hf_config: Any) -> int:
    return sum(math.prod(s) for s in hf_parameter_shapes(hf_config).values())
