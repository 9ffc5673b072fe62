"""HF <-> Megatron-core weight mapping and config translation (nemo_like.models.policy.megatron_mapping, megatron_dims),
on the CPU with the real megatron-core and tiny random HF models.

Megatron's forward wants CUDA in three places only (the rotary table moved to
``torch.cuda.current_device()``, its memory buffer, and the CUDA RNG tracker forked around attention
dropout); the ``megatron_cpu`` fixture runs the module in ``cpu_forward_context``, which points the first
two at the CPU and gives a tracker whose fork does nothing, so the forward (and a training step) is
compared with HF's on the CPU too.
"""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'nemo_like[megatron]')")

from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config  # noqa: E402

from nemo_like.models.policy import megatron_mapping as mm  # noqa: E402
from nemo_like.models.policy.megatron_dims import model_dims  # noqa: E402

SHAPE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=128, max_position_embeddings=256)
CASES = {
    "llama": lambda **kw: LlamaConfig(**(SHAPE | kw)),
    "llama_tied": lambda **kw: LlamaConfig(**(SHAPE | {"tie_word_embeddings": True} | kw)),
    "qwen2": lambda **kw: Qwen2Config(**(SHAPE | {"rope_theta": 1e6} | kw)),
    # head_dim 32 != hidden / heads: Megatron's kv_channels carries it.
    "qwen3": lambda **kw: Qwen3Config(**(SHAPE | {"head_dim": 32, "tie_word_embeddings": True} | kw)),
}


@pytest.fixture(scope="module")
def megatron_cpu():
    """torch.distributed (gloo, one rank) and megatron's parallel state for this module, and
    megatron's CUDA-only bits pointed at the CPU (cpu_forward_context); undone after, so other
    modules of the session see none of it."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    started = not dist.is_initialized()
    original = torch.cuda.current_device
    with mm.cpu_forward_context():
        mm.init_model_parallel("gloo")
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if started and dist.is_initialized():
                dist.destroy_process_group()
    assert torch.cuda.current_device is original, "a CPU worker's cpu_forward_context was left open"


def _hf_model(cfg, seed: int = 0):
    """A random HF model whose norms and biases are not their initial constants (so a swapped norm
    or bias would show)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


# ---- config translation ------------------------------------------------------------------------

def test_config_llama_values():
    cfg = CASES["llama"](rms_norm_eps=1e-5, rope_theta=5e5)
    tc, kw = mm.megatron_config_from_hf(cfg, params_dtype=torch.bfloat16)
    assert (tc.num_layers, tc.hidden_size, tc.num_attention_heads, tc.num_query_groups) == (2, 64, 4, 2)
    assert (tc.ffn_hidden_size, tc.kv_channels, tc.layernorm_epsilon) == (96, 16, 1e-5)
    assert tc.normalization == "RMSNorm" and tc.gated_linear_unit and tc.activation_func is torch.nn.functional.silu
    assert not tc.add_bias_linear and not tc.add_qkv_bias and not tc.qk_layernorm
    assert tc.hidden_dropout == 0.0 and tc.attention_dropout == 0.0
    assert tc.params_dtype is torch.bfloat16 and tc.bf16 and not tc.fp16
    assert kw == dict(vocab_size=128, max_sequence_length=256, position_embedding_type="rope", rotary_percent=1.0,
                      rotary_base=5e5, share_embeddings_and_output_weights=False, parallel_output=True,
                      pre_process=True, post_process=True)


def test_config_qwen2_qwen3_values():
    tc, kw = mm.megatron_config_from_hf(CASES["qwen2"]())
    assert tc.add_qkv_bias and not tc.qk_layernorm and kw["rotary_base"] == 1e6
    assert not kw["share_embeddings_and_output_weights"]
    tc, kw = mm.megatron_config_from_hf(CASES["qwen3"]())
    assert tc.qk_layernorm and not tc.add_qkv_bias and tc.kv_channels == 32
    assert kw["share_embeddings_and_output_weights"]
    assert tc.params_dtype is torch.float32 and not tc.bf16


def test_config_from_a_plain_dict_and_transformers4_style_rope():
    d = dict(SHAPE, model_type="llama", rope_theta=123.0, rope_scaling=None, tie_word_embeddings=True)
    dims = model_dims(d)
    assert dims.rope_theta == 123.0 and dims.tied and dims.head_dim == 16 and dims.q_per_group == 2


@pytest.mark.parametrize("cfg, field, value_text", [
    (dict(SHAPE, model_type="gpt2"), "model_type", "'gpt2'"),
    (CASES["llama"](rope_scaling={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}), "rope_", "llama3"),
    (dict(SHAPE, model_type="llama", rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling", "linear"),
    (CASES["llama"](attention_bias=True), "attention_bias", "True"),
    (CASES["llama"](mlp_bias=True), "mlp_bias", "True"),
    (CASES["llama"](hidden_act="gelu"), "hidden_act", "'gelu'"),
    (dict(SHAPE, model_type="qwen2", use_sliding_window=True, sliding_window=64), "use_sliding_window", "True"),
])
def test_refusals_name_field_value_and_supported(cfg, field, value_text):
    with pytest.raises(ValueError) as e:
        mm.megatron_config_from_hf(cfg)
    msg = str(e.value)
    assert f"unsupported HF config {field}" in msg and value_text in msg and "supported:" in msg
    if field == "model_type":
        assert "llama, qwen2, qwen3" in msg


def test_missing_megatron_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"pip install 'nemo_like\[megatron\]'"):
        mm.megatron_config_from_hf(CASES["llama"]())
    # The weight mapping itself needs no megatron.
    sd = _hf_model(CASES["llama"]()).state_dict()
    assert "output_layer.weight" in mm.hf_to_megatron_state_dict(sd, CASES["llama"]())


# ---- weights --------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_identity(case):
    cfg = CASES[case]()
    hf_sd = _hf_model(cfg).state_dict()
    mc = mm.hf_to_megatron_state_dict(hf_sd, cfg)
    back = mm.megatron_to_hf_state_dict(mc, cfg, with_tied_lm_head=True)
    assert set(back) == set(hf_sd)
    for k, v in hf_sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    # Without the tied head: the names and order of named_parameters, and shapes from the config alone.
    plain = mm.megatron_to_hf_state_dict(mc, cfg)
    model = _hf_model(cfg)
    assert list(plain) == [n for n, _ in model.named_parameters()] == mm.hf_parameter_names(cfg)
    assert mm.hf_parameter_shapes(cfg) == {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert mm.num_parameters(cfg) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("case", list(CASES))
def test_loads_strict_into_gpt_model(megatron_cpu, case):
    cfg = CASES[case]()
    model = mm.build_gpt_model(cfg, use_cpu_initialization=True)
    own = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    mc = mm.hf_to_megatron_state_dict(_hf_model(cfg).state_dict(), cfg)
    assert {k: tuple(v.shape) for k, v in mc.items()} == own
    mm.load_megatron_state_dict(model, mc)
    got = mm.megatron_state_dict(model)
    assert all(torch.equal(got[k], mc[k]) for k in mc)
    tied = cfg.tie_word_embeddings
    assert ("output_layer.weight" in own) == (not tied)
    # Megatron -> HF of the loaded model loads strictly into HF.
    fresh = AutoModelForCausalLM.from_config(cfg).float()
    fresh.load_state_dict(mm.megatron_to_hf_state_dict(got, cfg, with_tied_lm_head=True), strict=True)


def test_local_spec_key_names(megatron_cpu):
    """The megatron-core 0.16.1 local-spec names the mapping writes (qwen2: with the qkv bias)."""
    cfg = CASES["qwen2"]()
    keys = [k for k in mm.build_gpt_model(cfg, use_cpu_initialization=True).state_dict()
            if not k.endswith("_extra_state")]
    layer0 = sorted(k.removeprefix("decoder.layers.0.") for k in keys if k.startswith("decoder.layers.0."))
    assert layer0 == ["input_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
                      "pre_mlp_layernorm.weight", "self_attention.linear_proj.weight",
                      "self_attention.linear_qkv.bias", "self_attention.linear_qkv.weight"]
    assert {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"} <= set(keys)
    model = mm.build_gpt_model(CASES["qwen3"](), use_cpu_initialization=True)
    assert isinstance(model.decoder.layers[0].self_attention.q_layernorm, torch.nn.RMSNorm)
    assert isinstance(model.decoder.final_layernorm, torch.nn.RMSNorm)


def test_fused_qkv_layout_by_hand():
    """4 query heads, 2 groups, head_dim 16: rows of group g are q heads 2g, 2g+1, then k head g, then
    v head g, each head a constant block (q head h = 100 + h, k head g = 200 + g, v head g = 300 + g)."""
    cfg = CASES["qwen2"]()
    sd = _hf_model(cfg).state_dict()
    hd, H = 16, 64
    for kind, base, heads in (("q", 100, 4), ("k", 200, 2), ("v", 300, 2)):
        w = torch.cat([torch.full((hd, H), float(base + h)) for h in range(heads)])
        sd[f"model.layers.0.self_attn.{kind}_proj.weight"] = w
        sd[f"model.layers.0.self_attn.{kind}_proj.bias"] = w[:, 0].clone() + 0.5
    mc = mm.hf_to_megatron_state_dict(sd, cfg)
    qkv = mc["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == (2 * (2 + 2) * hd, H)
    expected_heads = [100, 101, 200, 300, 102, 103, 201, 301]
    got_heads = [float(qkv[i * hd: (i + 1) * hd].unique().item()) for i in range(8)]
    assert got_heads == expected_heads
    bias = mc["decoder.layers.0.self_attention.linear_qkv.bias"]
    assert [float(bias[i * hd: (i + 1) * hd].unique().item()) for i in range(8)] == [h + 0.5 for h in expected_heads]


def test_fc1_is_gate_then_up():
    cfg = CASES["llama"]()
    sd = _hf_model(cfg).state_dict()
    sd["model.layers.1.mlp.gate_proj.weight"] = torch.full((96, 64), 1.0)
    sd["model.layers.1.mlp.up_proj.weight"] = torch.full((96, 64), 2.0)
    fc1 = mm.hf_to_megatron_state_dict(sd, cfg)["decoder.layers.1.mlp.linear_fc1.weight"]
    assert fc1.shape == (192, 64) and (fc1[:96] == 1).all() and (fc1[96:] == 2).all()


def test_tied_and_untied_output_layer():
    for case, tied in (("llama", False), ("llama_tied", True)):
        cfg = CASES[case]()
        sd = _hf_model(cfg).state_dict()
        mc = mm.hf_to_megatron_state_dict(sd, cfg)
        assert ("output_layer.weight" in mc) is (not tied)
        hf = mm.megatron_to_hf_state_dict(mc, cfg)
        assert ("lm_head.weight" in hf) is (not tied)
        if not tied:
            assert torch.equal(mc["output_layer.weight"], sd["lm_head.weight"])
    # A tied config whose lm_head differs from the embedding is refused, not silently dropped.
    cfg = CASES["llama_tied"]()
    sd = {k: v.clone() for k, v in _hf_model(cfg).state_dict().items()}
    sd["lm_head.weight"] += 1
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        mm.hf_to_megatron_state_dict(sd, cfg)


def test_unknown_and_missing_keys_are_refused():
    cfg = CASES["llama"]()
    sd = dict(_hf_model(cfg).state_dict())
    with pytest.raises(ValueError, match="does not know.*model.extra.weight"):
        mm.hf_to_megatron_state_dict(sd | {"model.extra.weight": torch.zeros(1)}, cfg)
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        mm.hf_to_megatron_state_dict(sd, cfg)
    mc = mm.hf_to_megatron_state_dict(_hf_model(cfg).state_dict(), cfg)
    mc["decoder.layers.0.self_attention.linear_proj._extra_state"] = None  # ignored
    mm.megatron_to_hf_state_dict(mc, cfg)
    with pytest.raises(ValueError, match="does not know"):
        mm.megatron_to_hf_state_dict(mc | {"decoder.layers.9.x.weight": torch.zeros(1)}, cfg)


# ---- the forward, on the CPU -------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_cpu_forward_matches_hf(megatron_cpu, case):
    """Same logits as HF (fp32): the layout, RoPE base, GQA grouping, norms and biases all line up.
    Right padding: real tokens never see the pads under the causal mask."""
    cfg = CASES[case](rope_theta=5000.0) if case != "qwen2" else CASES[case]()
    hf = _hf_model(cfg, seed=1)
    model = mm.build_gpt_model(cfg, use_cpu_initialization=True, perform_initialization=False).eval()
    mm.load_megatron_state_dict(model, mm.hf_to_megatron_state_dict(hf.state_dict(), cfg))
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (3, 13))
    lengths = torch.tensor([13, 9, 4])
    mask = (torch.arange(13)[None] < lengths[:, None]).long()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        got = mm.gpt_logits(model, ids)
    assert got.shape == ref.shape
    real = mask.bool()
    assert (got[real] - ref[real]).abs().max() < 1e-4
    lp_ref = mm.token_logprobs_from_logits(ref, ids)
    lp = mm.token_logprobs_from_logits(got, ids)
    assert (lp[real] - lp_ref[real]).abs().max() < 1e-4 and (lp[:, 0] == 0).all()


def test_cpu_training_step_and_export(megatron_cpu):
    """A step of AdamW on -mean log-prob lowers the loss; the exported HF weights compute the
    Megatron model's logits after the step."""
    cfg = CASES["llama_tied"]()
    hf = _hf_model(cfg, seed=3)
    model = mm.build_gpt_model(cfg, use_cpu_initialization=True, perform_initialization=False)
    mm.load_megatron_state_dict(model, mm.hf_to_megatron_state_dict(hf.state_dict(), cfg))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(4))

    def loss_fn():
        return -mm.token_logprobs_from_logits(mm.gpt_logits(model, ids), ids)[:, 1:].mean()

    loss0 = loss_fn()
    loss0.backward()
    assert model.embedding.word_embeddings.weight.grad is not None
    opt.step()
    opt.zero_grad()
    model.eval()
    with torch.no_grad():
        loss1 = loss_fn()
        logits = mm.gpt_logits(model, ids)
    assert torch.isfinite(loss0) and loss1 < loss0
    fresh = AutoModelForCausalLM.from_config(cfg).float().eval()
    fresh.load_state_dict(mm.megatron_to_hf_state_dict(mm.megatron_state_dict(model), cfg, with_tied_lm_head=True),
                          strict=True)
    with torch.no_grad():
        assert (fresh(input_ids=ids).logits - logits).abs().max() < 1e-4


def test_bf16_model_is_bf16_throughout(megatron_cpu):
    """The local spec's norms are made in float32; build_gpt_model casts them with the rest."""
    model = mm.build_gpt_model(CASES["qwen3"](), params_dtype=torch.bfloat16, use_cpu_initialization=True,
                               perform_initialization=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.decoder.final_layernorm.weight.dtype is torch.bfloat16


# ---- the worker (nemo_like.models.policy.megatron_worker), in process, against the HF worker ---------

def _worker_batch():
    torch.manual_seed(0)
    b, t = 4, 24
    ids = torch.randint(5, 90, (b, t))
    lengths = torch.tensor([24, 17, 9, 20])
    real = torch.arange(t)[None] < lengths[:, None]
    ids[~real] = 0
    token_mask = real.float()
    token_mask[:, 0] = 0
    from nemo_like.distributed.batched_data_dict import BatchedDataDict

    return BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=torch.ones(b)), real


def test_worker_matches_hf_worker_fp32(megatron_cpu, model_dir, tmp_path):
    """Same log-probs, same training step (loss, grad norm, resulting log-probs), same exported names;
    its checkpoint is an HF folder it (and HF) reload; an HF worker's optimizer state is refused."""
    from nemo_like.algorithms.loss_functions import NLLLossFn
    from nemo_like.models.policy.hf_worker import HFPolicyWorker
    from nemo_like.models.policy.interfaces import PolicyConfig
    from nemo_like.models.policy.megatron_worker import MegatronPolicyWorker

    cfg = PolicyConfig(model_name=model_dir, train_global_batch_size=4, train_micro_batch_size=2,
                       logprob_batch_size=2, max_total_sequence_length=64, optimizer={"lr": 1e-3})
    data, real = _worker_batch()
    scored = data["token_mask"].bool()
    threads = torch.get_num_threads()  # the workers set their own; the rest of the session keeps its
    workers = [MegatronPolicyWorker(cfg, seed=0)]
    mw, hw = workers[0], HFPolicyWorker(cfg, seed=0)
    try:
        lm, lh = mw.get_logprobs(data)["logprobs"], hw.get_logprobs(data)["logprobs"]
        assert (lm - lh)[real].abs().max() < 1e-5 and (lm[~real] == 0).all()
        assert torch.equal(mw.get_reference_policy_logprobs(data)["reference_logprobs"], lm)
        assert mw.weights_manifest() == hw.weights_manifest()
        assert mw.weights_checksum() == hw.weights_checksum()  # the same float32 weights, same names

        m_metrics, h_metrics = mw.train(data, NLLLossFn()), hw.train(data, NLLLossFn())
        for k in ("loss", "grad_norm", "trained_tokens", "padding_efficiency", "lr"):
            assert m_metrics[k] == pytest.approx(h_metrics[k], rel=1e-4), k
        lm2, lh2 = mw.get_logprobs(data)["logprobs"], hw.get_logprobs(data)["logprobs"]
        assert (lm2 - lh2)[scored].abs().max() < 1e-4 and (lm2 - lm)[scored].abs().max() > 1e-2
        # The reference is still the initial weights, and the swap leaves the trained ones in place.
        assert torch.equal(mw.get_reference_policy_logprobs(data)["reference_logprobs"], lm)
        assert torch.equal(mw.get_logprobs(data)["logprobs"], lm2)

        mw.save_checkpoint(str(tmp_path / "mg"))
        hw.save_checkpoint(str(tmp_path / "hf"))
        workers.append(again := MegatronPolicyWorker(cfg, seed=0, init_reference_model=False))
        again.load_checkpoint(str(tmp_path / "mg"))
        assert torch.equal(again.get_logprobs(data)["logprobs"], lm2)
        assert again.scheduler.last_epoch == 1
        with pytest.raises(RuntimeError, match="not written by the Megatron worker"):
            again.load_checkpoint(str(tmp_path / "hf"))
        again.load_checkpoint(str(tmp_path / "hf"), load_optimizer=False)
        assert (again.get_logprobs(data)["logprobs"] - lh2)[scored].abs().max() < 1e-4
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "mg"))  # a plain HF folder
    finally:
        for w in workers:
            w._cpu_context.close()  # not shutdown(): the module's process group stays for the next tests
        torch.set_num_threads(threads)


def test_worker_refuses_unsupported_settings(model_dir):
    from nemo_like.models.policy.interfaces import PolicyConfig
    from nemo_like.models.policy.megatron_worker import check_megatron_supported

    cfg = PolicyConfig(model_name=model_dir, lora={"enabled": True}, sequence_packing={"enabled": True})
    with pytest.raises(ValueError, match=r"policy.lora.enabled.*policy.sequence_packing.enabled"):
        check_megatron_supported(cfg)
