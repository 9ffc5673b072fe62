"""GRPO graded by a service over HTTP, as examples/configs/grpo_http_math_tiny.yaml runs it: the run
starts the Node grader itself (env.http.command), every answer is graded by it exactly as the math
rule grades it, and when the service dies mid-run it is started again for the next step (what a
service that stays down costs, and that a killed actor takes its service along:
tests/unit/environments/test_http_environment.py).
Real Ray, the real trainer, a real Node process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray

from nemo_like import GRPOExperiment
from nemo_like.environments.interfaces import last_assistant_text
from nemo_like.environments.math_environment import verify_math_answer

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "grpo_http_math_tiny.yaml"


def _overrides(tmp: Path, model_dir: str) -> list[str]:
    # The untrained tiny model (no bootstrap): this checks what grading does, not what is learned.
    return [
        f"policy.model_name={model_dir}",
        "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "grpo.dynamic_sampling.enabled=false",
        "grpo.max_num_steps=2", "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
        "grpo.max_val_samples=4",
        "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=8", "policy.generation_batch_size=8",
        "data.train.generator.num_samples=50", "data.validation.generator.num_samples=4",
        # 3 samples a request: a step's 8 go in 3 requests; a dead service is given up on quickly
        "env.http.max_batch_size=3", "env.http.max_retries=2", "env.http.retry_backoff_s=0.05",
        f"logger.log_dir={tmp / 'logs'}", "logger.tensorboard_enabled=false",
        f"checkpointing.checkpoint_dir={tmp / 'ckpt'}", "checkpointing.enabled=false",
    ]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_grpo_graded_by_a_node_service_the_run_starts(ray_session, tmp_path, model_dir):
    with GRPOExperiment(str(CONFIG), _overrides(tmp_path, model_dir)) as exp:
        trainer = exp.trainer
        actor = trainer.envs["math"]
        pid, url = ray.get(actor.__ray_call__.remote(lambda self: (self._proc.pid, self.url)), timeout=60)
        assert url.startswith("http://127.0.0.1:") and _alive(pid)
        val = exp.validate()  # greedy, held-out: graded by the same service
        assert val["val/num_samples"] == 4 and 0.0 <= val["val/accuracy"] <= 1.0

        first = exp.step()
        batch = trainer.last_batch
        rewards = batch["total_reward"].tolist()
        # The Node grader's verdict on every answer is the math rule's.
        expected = [verify_math_answer(last_assistant_text(log), info["ground_truth"])
                    for log, info in zip(batch["message_log"], batch["extra_env_info"])]
        assert rewards == expected
        assert first["train/unscorable_frac"] == 0.0 and first["train/env/math/num_unscorable"] == 0
        assert first["train/env/math/accuracy"] == pytest.approx(sum(rewards) / len(rewards))  # the service's own metric

        os.kill(pid, 9)  # the service dies between steps: it is started again, as a dead actor would be
        second = exp.step()
        assert trainer.step_count == 2
        assert second["train/env/math/num_service_restarts"] == 1 and second["train/unscorable_frac"] == 0.0
        pid2 = ray.get(actor.__ray_call__.remote(lambda self: self._proc.pid), timeout=60)
        assert pid2 != pid and _alive(pid2) and not _alive(pid)
