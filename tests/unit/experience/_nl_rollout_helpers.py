"""Shared by the rollout tests: a counting environment and a real HF model generating in this process."""

from __future__ import annotations

import contextlib

import ray
import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from nemo_like.models.generation.hf_generation import hf_generate
from nemo_like.models.generation.interfaces import GenerationConfig
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama


class CountdownEnv(EnvironmentInterface):
    """Answers each turn with "left=<k>"; terminates with reward 1 after `turns` assistant turns
    and gives `step_reward` for each earlier turn. Keeps its count in the returned metadata."""

    def __init__(self, config=None):
        self.name = (config or {}).get("name", "countdown")

    def step(self, message_log_batch, metadata):
        obs, meta, rewards, done = [], [], [], []
        for log, m in zip(message_log_batch, metadata):
            seen = m.get("seen", 0) + 1
            left = m["turns"] - seen
            obs.append({"role": "environment", "content": f"{self.name} left={left}"})
            meta.append(m | {"seen": seen, "last": log[-1]["content"]})
            rewards.append(1.0 if left <= 0 else m.get("step_reward", 0.0))
            done.append(left <= 0)
        return EnvironmentReturn(obs, meta, [["!"]] * len(obs), torch.tensor(rewards),
                                 torch.tensor(done), {"num_calls": float(len(obs))})


class LocalHF:
    """A real HF model generating in this process (the Policy's workers run the same function)."""

    def __init__(self, model, tok, max_new_tokens=5, max_total=200):
        self.model, self.tok, self.max_total = model, tok, max_total
        self.cfg = GenerationConfig(max_new_tokens=max_new_tokens, temperature=1.0)
        self.calls: list[BatchedDataDict] = []

    def generate(self, data, greedy=False):
        self.calls.append(data)
        return hf_generate(self.model, self.tok, data, self.cfg, greedy=greedy, max_total_length=self.max_total,
                           micro_batch_size=64, synced=False, device=torch.device("cpu"))


def _batch(tok, specs):
    logs, infos, tasks = [], [], []
    for task, turns in specs:
        text = tok.apply_chat_template([{"role": "user", "content": f"go {task}"}], tokenize=False,
                                       add_generation_prompt=True)
        logs.append([{"role": "user", "content": text,
                      "token_ids": torch.tensor(tok(text, add_special_tokens=False)["input_ids"])}])
        infos.append({"turns": turns, "step_reward": 0.25})
        tasks.append(task)
    return BatchedDataDict(message_log=logs, extra_env_info=infos, task_name=tasks,
                           loss_multiplier=torch.ones(len(logs)))


@contextlib.contextmanager
def rollout_setup(envs: dict):
    """``(envs, tokenizer, model)``: the environment actors given and a seeded 1-layer tiny model; the
    actors are killed on exit."""
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=256)
    try:
        yield envs, tok, model
    finally:
        for actor in envs.values():
            ray.kill(actor, no_restart=True)
