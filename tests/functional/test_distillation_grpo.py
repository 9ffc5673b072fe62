"""On-policy distillation through real workers: a teacher that is the student itself scores every
sampled token as the student does (a zero gap, top-k included, packed), a different teacher pulls the
student towards it step after step, the teacher runs on a pool of its own, and a teacher of another
tokenizer is refused before Ray starts."""

from __future__ import annotations

import os

import pytest

from nemo_like import GRPOExperiment
from nemo_like.algorithms.grpo_run import setup
from nemo_like.config import ConfigError, load_config
from nemo_like.models.bootstrap import ensure_base_model

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "grpo_math_tiny.yaml")


def _cfg(tmp_path, base_model_cache, *extra: str):
    # The reward-model test's base recipe: the session's cache builds it once for both.
    return load_config(CONFIG, [
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.dynamic_sampling.enabled=false",
        "grpo.val_period=0", "grpo.val_at_start=false", "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=16", "policy.logprob_batch_size=16", "policy.generation_batch_size=16",
        "data.train.generator.num_samples=40", "data.validation.generator.num_samples=8",
        "bootstrap.model.hidden_size=32", "bootstrap.model.num_layers=1", "bootstrap.sft.num_steps=2",
        "bootstrap.sft.batch_size=16", "bootstrap.sft.micro_batch_size=16", "bootstrap.num_workers=1",
        f"bootstrap.cache_dir={base_model_cache}", f"logger.log_dir={tmp_path / 'logs'}",
        "logger.tensorboard_enabled=false", "checkpointing.enabled=false", "cluster.num_cpus=null", *extra])


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_the_student_as_its_own_teacher_agrees_token_for_token(ray_session, tmp_path, base_model_cache):
    # Everything at once, from the notebook API: async rollouts (a rollout worker samples; the teacher
    # scores at training time), LoRA on the student (its adapter starts at zero: the base model),
    # packed passes, the top-k objective, and one sample a prompt (the teacher's signal needs no group:
    # without rewards a lone sample's group advantage is left out).
    base = ensure_base_model(_cfg(tmp_path, base_model_cache))
    exp = GRPOExperiment(_cfg(tmp_path, base_model_cache, "grpo.max_num_steps=2", f"teacher.model_name={base}",
                              "grpo.num_prompts_per_step=16", "grpo.num_generations_per_prompt=1",
                              "teacher.objective=topk", "teacher.topk_k=4", "policy.sequence_packing.enabled=true",
                              "policy.lora.enabled=true", "policy.lora.target_modules=all-linear",
                              "grpo.async_rollouts.enabled=true", "policy.generation.colocated=false",
                              "loss_fn.use_importance_sampling_correction=true",
                              "cluster.cpus_per_worker=1", "cluster.generation.cpus_per_worker=1"))
    try:
        first, second = exp.train(steps=2)
    finally:
        exp.close()
    # The same weights score the sampled tokens as the sampler did: no gap, no top-k KL (the packed
    # rows of the student's pass and the teacher's line up position for position).
    assert abs(first["distill/reverse_kl"]) < 1e-4 and first["distill/teacher_logprob_mean"] < -0.01
    assert first["distill/teacher_logprob_mean"] == pytest.approx(first["distill/student_logprob_mean"], abs=1e-4)
    assert abs(first["train/distill_topk_kl"]) < 1e-4 and first["timing/teacher_logprobs"] > 0
    # A student that is its teacher has nothing to learn (its KL is at its minimum, the rewards weigh 0):
    # its adapter stays at zero, and the second step agrees as the first did.
    assert abs(second["train/distill_topk_kl"]) < 1e-4 and abs(second["distill/reverse_kl"]) < 1e-4
    assert first["train/loss"] == pytest.approx(0.0, abs=1e-4) and second["train/loss"] == pytest.approx(0.0, abs=1e-4)


def test_a_teacher_on_its_own_pool_pulls_the_student_towards_it(ray_session, tmp_path, base_model_cache, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The teacher: the student's base with its final norm scaled, i.e. its logits times 8: the same
    # ranking of tokens, a much sharper distribution, far (in KL) from the student's at the start.
    base = ensure_base_model(_cfg(tmp_path, base_model_cache))
    teacher = AutoModelForCausalLM.from_pretrained(base)
    teacher.model.norm.weight.data *= 8.0
    teacher.save_pretrained(tmp_path / "teacher")
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp_path / "teacher")
    pools = ["cluster.resource_pools={train: {nodes: 1, cpus_per_node: 1}, teach: {nodes: 1, cpus_per_node: 1}}",
             "cluster.roles={policy: train, teacher: teach}", "cluster.cpus_per_worker=1"]
    cfg = _cfg(tmp_path, base_model_cache, "grpo.max_num_steps=20", f"teacher.model_name={tmp_path / 'teacher'}",
               "teacher.kl_coef=1.0", "policy.optimizer.lr=0.02", "policy.generation.temperature=1.0", *pools)
    trainer = setup(cfg)
    try:
        assert "  teacher -> pool 'teach' (1 node(s) x 1 CPU) -> node " in capsys.readouterr().out
        kls = [trainer.step()["distill/reverse_kl"] for _ in range(20)]
    finally:
        trainer.close()
    # The sampled estimate of KL(student || teacher) is noisy step to step: compared over five steps.
    first, last = sum(kls[:5]) / 5, sum(kls[-5:]) / 5
    assert first > 0.5 and last < 0.7 * first, kls


def test_a_teacher_of_another_tokenizer_is_refused_before_ray_starts(tmp_path, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    other = tmp_path / "other"
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(other)
    cfg = load_config(CONFIG, [f"policy.model_name={model_dir}", f"teacher.model_name={other}",
                               "checkpointing.enabled=false", "grpo.dynamic_sampling.enabled=false"])
    with pytest.raises(ConfigError, match=r"teacher.model_name=.*another tokenizer than the policy's.*share a "
                                          r"tokenizer \(cross-tokenizer distillation is not supported\)"):
        setup(cfg)
