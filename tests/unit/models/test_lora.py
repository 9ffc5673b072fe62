"""LoRA (policy.lora) on real Ray workers with the tiny char Llama: only the adapter trains, the
base with its adapter disabled is the reference, checkpoints resume exactly, a merged export computes
what the policy computes, and all of it on 2 FSDP2 ranks too."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import ray
import torch
from _nl_model_test_helpers import tokenized
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from nemo_like.algorithms.loss_functions import NLLLossFn
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.distributed.ray_cluster import RayVirtualCluster
from nemo_like.models.policy import PolicyConfig
from nemo_like.models.policy.hf_worker import token_logprobs
from nemo_like.models.policy.lm_policy import Policy
from nemo_like.models.policy.lora import apply_lora, refuse_adapter_checkpoint
from nemo_like.utils.checkpoint import CheckpointManager

TEXTS = ["12+34=46", "1+1=2", "3+4=7", "40+2=42", "5+5=10", "9+9=18", "2+2=4", "6+1=7"]


def _cfg(model_dir, lora=None, **kw) -> PolicyConfig:
    base = dict(model_name=model_dir, train_global_batch_size=8, train_micro_batch_size=4, logprob_batch_size=4,
                generation_batch_size=4, max_total_sequence_length=40, optimizer={"lr": 1e-2},
                generation={"max_new_tokens": 6, "temperature": 1.0},
                lora={"enabled": True, "rank": 4, "alpha": 8, "dropout": 0.1} | (lora or {}))
    return PolicyConfig(**(base | kw))


def _batch(model_dir, texts=TEXTS) -> BatchedDataDict:
    data = tokenized(AutoTokenizer.from_pretrained(model_dir), texts)
    data["token_mask"] = (torch.arange(data["input_ids"].shape[1])[None] < data["input_lengths"][:, None]).long()
    data["sample_mask"] = torch.ones(data.size)
    return data


def _hf_logprobs(model_or_dir, data: BatchedDataDict) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_or_dir) if isinstance(model_or_dir, (str, Path)) else model_or_dir
    with torch.no_grad():
        return token_logprobs(model, data["input_ids"], data["token_mask"], 1.0) * data["token_mask"]


def _weights(policy: Policy) -> dict[str, torch.Tensor]:
    """Every parameter, whole, as the workers hold it (FSDP shards gathered on all ranks at once)."""
    def whole(worker):
        return {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).cpu().clone()
                for n, p in worker.model.named_parameters()}
    return ray.get([w.__ray_call__.remote(whole) for w in policy.worker_group.workers])[0]


def _optimised_names(policy: Policy) -> list[str]:
    def names(worker):
        ids = {id(p) for g in worker.optimizer.param_groups for p in g["params"]}
        return sorted(n for n, p in worker.model.named_parameters() if id(p) in ids)
    return ray.get(policy.worker_group.workers[0].__ray_call__.remote(names))


def _hf_name(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.").replace(".base_layer", "")


def _check_only_adapter_trained(before, after, model_dir) -> None:
    base = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    adapter = [n for n in after if "lora_" in n]
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    for n in after:
        if n not in adapter:  # bit-identical to the base model on disk
            assert torch.equal(after[n], base[_hf_name(n)].detach()), n
    for n in adapter:
        assert not torch.equal(after[n], before[n]), n
        if ".lora_B." in n:  # B starts at zero: the adapted model starts as the base
            assert not before[n].any()


@pytest.fixture(scope="module")
def one(ray_session):
    c = RayVirtualCluster(1, cpus_per_worker=1, name="lora-one")
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def adapted(one, model_dir, tmp_path_factory):
    """A single-worker LoRA policy with dynamic batching: 2 steps, a checkpoint, 1 more step."""
    data = _batch(model_dir)
    p = Policy(one, _cfg(model_dir, dynamic_batching={"enabled": True, "max_tokens_per_microbatch": 64}),
               seed=0, name_prefix="lora")
    try:
        s = {"data": data, "before": _weights(p), "ckpt": tmp_path_factory.mktemp("lora") / "ckpt"}
        for _ in range(2):
            p.train(data, NLLLossFn())
        p.save_checkpoint(str(s["ckpt"]))
        s["lp2"] = p.get_logprobs(data)["logprobs"]
        s["m3"] = p.train(data, NLLLossFn())  # the uninterrupted third step
        s["after"], s["lp3"] = _weights(p), p.get_logprobs(data)["logprobs"]
        yield p, s
    finally:
        p.shutdown()


def test_config_refusals(model_dir):
    with pytest.raises(ValueError, match="list of module names or 'all-linear'"):
        PolicyConfig(model_name=model_dir, lora={"target_modules": "q_proj"})
    with pytest.raises(ValueError, match="target_modules is empty"):
        PolicyConfig(model_name=model_dir, lora={"target_modules": []})
    # A typo beside a correct name (peft alone would adapt q_proj and say nothing), and a block.
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"policy.lora.target_modules: \['qproj'\] not found in .*'o_proj', 'q_proj'"):
        apply_lora(model, _cfg(model_dir, lora={"target_modules": ["q_proj", "qproj"]}).lora, model_dir)
    with pytest.raises(ValueError, match=r"\['self_attn'\] name blocks of .*, not layers; name its linear modules instead: \['down_proj',"):
        apply_lora(model, _cfg(model_dir, lora={"target_modules": ["self_attn"]}).lora, model_dir)


def test_unknown_target_refused_at_policy_start(ray_session, model_dir):
    c = RayVirtualCluster(1, cpus_per_worker=1, name="lora-bad")
    try:
        with pytest.raises(RuntimeError, match=r"(?s)in '__init__'.*policy.lora.target_modules: \['attn_q'\] not found"):
            Policy(c, _cfg(model_dir, lora={"target_modules": ["attn_q"]}), name_prefix="lora-bad")
    finally:
        c.shutdown()


def test_only_adapter_weights_train_and_are_optimised(adapted, model_dir):
    p, s = adapted
    _check_only_adapter_trained(s["before"], s["after"], model_dir)
    assert _optimised_names(p) == sorted(n for n in s["after"] if "lora_" in n)


def test_reference_is_the_base_model(adapted, model_dir):
    p, s = adapted
    ref = p.get_reference_policy_logprobs(s["data"])["reference_logprobs"]
    assert (ref * s["data"]["token_mask"] - _hf_logprobs(model_dir, s["data"])).abs().max() < 1e-6
    assert (ref - s["lp3"]).abs().max() > 0.1  # the adapted policy moved away from it


def test_generation_uses_the_adapter(adapted, model_dir):
    p, s = adapted
    prompts = BatchedDataDict(input_ids=s["data"]["input_ids"][:4, :3], input_lengths=torch.full((4,), 3))
    out = p.generate(prompts)
    full = BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    lp = p.get_logprobs(full)["logprobs"]
    ref = p.get_reference_policy_logprobs(full)["reference_logprobs"]
    sampled = out["logprobs"] != 0
    assert torch.allclose(out["logprobs"][sampled], lp[sampled], atol=1e-4)  # the sampler is the adapted model
    assert (out["logprobs"][sampled] - ref[sampled]).abs().max() > 1e-2


def test_resume_equals_uninterrupted(adapted, model_dir):
    _, s = adapted
    files = {f.name for f in s["ckpt"].iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "lora.json", "optimizer.pt"} <= files
    assert all("lora_" in k for k in load_file(str(s["ckpt"] / "adapter_model.safetensors")))  # the adapter only
    c = RayVirtualCluster(1, cpus_per_worker=1, name="lora-resume")
    try:
        q = Policy(c, _cfg(model_dir, dynamic_batching={"enabled": True, "max_tokens_per_microbatch": 64}), seed=0,
                   name_prefix="lora-resume", weights_path=str(s["ckpt"]))
        try:
            assert torch.equal(q.get_logprobs(s["data"])["logprobs"], s["lp2"])
            m3 = q.train(s["data"], NLLLossFn())  # dropout draws from the restored RNG, AdamW from its moments
            w = _weights(q)
            assert m3["loss"] == s["m3"]["loss"] and m3["grad_norm"] == s["m3"]["grad_norm"]
            assert all(torch.equal(w[n], s["after"][n]) for n in w)
            assert torch.equal(q.get_logprobs(s["data"])["logprobs"], s["lp3"])
        finally:
            q.shutdown()
    finally:
        c.shutdown()
    # What a policy without LoRA runs first in load_checkpoint: it is told what the folder holds,
    # not a list of missing tensors.
    with pytest.raises(RuntimeError, match="holds a LoRA adapter"):
        refuse_adapter_checkpoint(s["ckpt"])


def test_export_merged_computes_like_the_policy(adapted, tmp_path):
    p, s = adapted
    p.export_merged(str(tmp_path / "merged"))
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    assert not any("lora" in k for k in load_file(str(tmp_path / "merged" / "model.safetensors")))
    am = s["data"]["token_mask"]
    assert (_hf_logprobs(tmp_path / "merged", s["data"]) - s["lp3"] * am).abs().max() < 1e-5


def test_export_script_from_a_grpo_checkpoint(adapted, model_dir, tmp_path):
    """examples/export_model.py on a manifest-verified step_N (the layout GRPO writes); a damaged one is refused."""
    _, s = adapted
    spec = importlib.util.spec_from_file_location("export_model", Path(__file__).parents[3] / "examples" / "export_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    mgr = CheckpointManager({"checkpoint_dir": str(tmp_path / "ckpts"), "metric_name": None})
    tmp = mgr.init_tmp_checkpoint(2, {"step": 2})
    shutil.copytree(s["ckpt"], tmp / "policy")
    (tmp / "run_config.json").write_text(json.dumps({"policy": json.loads(_cfg(model_dir).model_dump_json())}))
    step = mgr.finalize_checkpoint(tmp)
    assert script.main(["--checkpoint", str(step), "--out", str(tmp_path / "hf")]) == 0
    am = s["data"]["token_mask"]
    assert (_hf_logprobs(tmp_path / "hf", s["data"]) - s["lp2"] * am).abs().max() < 1e-5
    with open(step / "policy" / "adapter_model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\0\0\0\0")
    assert script.main(["--checkpoint", str(step), "--out", str(tmp_path / "hf2")]) == 2


def test_two_fsdp_ranks(ray_session, adapted, model_dir, tmp_path):
    """Adapters sharded with their layers on 2 ranks, with sequence packing and activation
    checkpointing: the same guarantees, and a checkpoint of another recipe or without adapter refused."""
    _, s = adapted
    data = _batch(model_dir)
    c = RayVirtualCluster(2, cpus_per_worker=1, name="lora-two")
    try:
        p = Policy(c, _cfg(model_dir, lora={"rank": 8, "dropout": 0.0, "target_modules": "all-linear"},
                           sequence_packing={"enabled": True, "max_tokens_per_microbatch": 64},
                           activation_checkpointing=True), seed=0, name_prefix="lora-two")
        try:
            before = _weights(p)
            for _ in range(2):
                p.train(data, NLLLossFn())
            _check_only_adapter_trained(before, _weights(p), model_dir)
            lp = p.get_logprobs(data)["logprobs"]
            ref = p.get_reference_policy_logprobs(data)["reference_logprobs"]
            assert (ref * data["token_mask"] - _hf_logprobs(model_dir, data)).abs().max() < 1e-5  # packed vs one by one
            assert (ref - lp).abs().max() > 0.1
            out = p.generate(BatchedDataDict(input_ids=data["input_ids"][:4, :3], input_lengths=torch.full((4,), 3)))
            assert out.size == 4
            p.save_checkpoint(str(tmp_path / "ckpt"))
            p.export_merged(str(tmp_path / "merged"))
            assert (_hf_logprobs(tmp_path / "merged", data) - lp * data["token_mask"]).abs().max() < 1e-5
            p.train(data, NLLLossFn())
            p.get_logprobs(data)  # a forward-only pass leaves the root's parameters unsharded
            p.load_checkpoint(str(tmp_path / "ckpt"))
            assert torch.equal(p.get_logprobs(data)["logprobs"], lp)
            with pytest.raises(RuntimeError, match=r"trained with policy.lora.rank=4, policy.lora.target_modules="):
                p.load_checkpoint(str(s["ckpt"]))
            with pytest.raises(RuntimeError, match="no LoRA adapter"):
                p.load_checkpoint(model_dir)
        finally:
            p.shutdown()
    finally:
        c.shutdown()
