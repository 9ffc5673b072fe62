"""GRPO on TextArena games end to end: a single-player game (GuessTheNumber) and a two-player one
(TicTacToe against the scripted opponent) trained together for two steps through real Ray, the real
``textarena`` environment actors and a tiny bootstrapped model; episodes run several turns and end
with the games' own rewards."""

from __future__ import annotations

import math
import os

import pytest

from nemo_like.algorithms.grpo import grpo_train
from nemo_like.algorithms.grpo_run import setup
from nemo_like.config import load_config

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", "grpo_textarena_tiny.yaml")

# The tiny model answers \boxed{N} with small N (what its short SFT taught it): a number of 1..9 guessed in two
# tries is missed by a repeated guess (the game's illegal move) and otherwise scored by how close the second
# guess came, so a group's rewards differ and GRPO has a gradient. TicTacToe is not over after two moves:
# its episodes end unfinished (reward 0).
_GAMES = {"guess": ("GuessTheNumber-v0", "{min_number: 1, max_number: 9, max_turns: 1}"),
          "tictactoe": ("TicTacToe-v0", "{}")}


def _datasets(split: str, n: int) -> str:
    rows = [f"{{task_name: {task}, env_name: textarena, generator: {{kind: textarena, game: {game}, split: {split}, "
            f"num_samples: {n}, seed: 1, options: {options}}}}}" for task, (game, options) in _GAMES.items()]
    return "[" + ", ".join(rows) + "]"


@pytest.mark.slow  # over 15 s: run by `uv run pytest -m slow` (CI runs it after the default suite)
def test_grpo_trains_single_and_two_player_games_for_two_steps(ray_session, tmp_path, base_model_cache):
    cfg = load_config(CONFIG, [
        f"data.train={_datasets('train', 16)}", f"data.validation={_datasets('validation', 2)}",
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2",
        "grpo.max_rollout_turns=2", "grpo.val_period=2", "grpo.val_at_start=false", "grpo.max_val_samples=2",
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16", "policy.logprob_batch_size=16",
        "policy.generation_batch_size=16", "policy.max_total_sequence_length=960", "policy.generation.max_new_tokens=12",
        "data.max_input_seq_length=700", "env.textarena.opponent=first",
        "bootstrap.model.hidden_size=64", "bootstrap.model.num_layers=2",
        "bootstrap.sft.num_steps=300", "bootstrap.sft.batch_size=32", "bootstrap.sft.micro_batch_size=32",
        f"bootstrap.cache_dir={base_model_cache}",
        f"logger.log_dir={tmp_path / 'logs'}", "logger.tensorboard_enabled=false",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", "checkpointing.enabled=false",
    ])
    trainer = setup(cfg)
    try:
        results = grpo_train(trainer)
        assert trainer.step_count == 2 and len(results) == 2
        assert all(math.isfinite(m["train/loss"]) for m in results)
        trained = [m for m in results if m["train/loss"] != 0.0]  # a step whose groups' rewards differed
        assert trained, [m["train/reward_std"] for m in results]
        for m in trained:  # the sampler's log-probs and the trainer's agree on the multi-turn rows
            assert abs(m["train/token_mult_prob_error"] - 1.0) < 0.02
        batch = trainer.last_batch
        assert set(batch["task_name"]) == set(_GAMES)
        rewards = batch["total_reward"].tolist()
        for i, log in enumerate(batch["message_log"]):
            task, turns = batch["task_name"][i], int(batch["num_turns"][i])
            roles = [m["role"] for m in log]
            assert roles == ["user", "assistant", "user", "assistant"][: 2 * turns], roles
            if turns == 2 and task == "tictactoe":  # a legal move is answered by the opponent's
                reply = log[2]["content"]
                assert "attempted an invalid move" in reply or "[Player 1]" in reply, reply
            # The games' own rewards: GuessTheNumber in [0, 1]; TicTacToe unfinished after two moves (0), or
            # lost by two illegal moves in a row (-1).
            assert (0.0 <= rewards[i] <= 1.0) if task == "guess" else rewards[i] in (-1.0, 0.0), (task, rewards[i])
        last = results[-1]
        for task in _GAMES:
            assert last[f"train/env/{task}/num_game_errors"] == 0.0 and last[f"train/env/{task}/num_failures"] == 0.0
        assert last["val/num_samples"] == 4.0 and 0.0 <= last["val/accuracy"] <= 1.0
    finally:
        trainer.close()
