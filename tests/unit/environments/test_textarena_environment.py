"""TextArena games as rows and as the ``textarena`` environment: real games, played move by move from
message logs (the state is the log: every step replays it), with illegal moves, two-player games
against scripted opponents, and a game that raises costing only its own sample."""

from __future__ import annotations

import math
import re

import pytest

from nemo_like.data.textarena_tasks import (
    GameSession,
    TextArenaConfig,
    episode_seed,
    extract_move,
    generate_textarena_dataset,
)
from nemo_like.environments.textarena_environment import TextArenaEnvironment


def _rows(game: str, split: str, n: int, seed: int = 0, **options) -> list[dict]:
    cfg = TextArenaConfig(kind="textarena", game=game, split=split, num_samples=n, seed=seed, options=options)
    return list(generate_textarena_dataset(cfg))


def _log(row: dict, *moves: str) -> list[dict]:
    log = [{"role": "user", "content": row["problem"]}]
    for m in moves:
        log += [{"role": "assistant", "content": m}, {"role": "user", "content": "(the game's reply)"}]
    return log[:-1] if moves else log


def _meta(row: dict) -> dict:
    return {k: row[k] for k in ("ta_game", "ta_options", "ta_seed")} | {"ground_truth": ""}


# ------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("game, options, message", [
    ("GuessTheNumbr-v0", {}, r"no game 'GuessTheNumbr-v0' \(did you mean 'GuessTheNumber-v0'"),
    ("GuessTheNumber-v0", {"max_numbr": 50}, r"options.max_numbr: not an option .*\(did you mean options.max_number\?"),
    ("ThreePlayerTicTacToe-v0", {}, r"is not a one- or two-player game"),
    ("Othello-v0", {}, r"two-player game without a scripted opponent here \(games with one: ConnectFour, Nim, TicTacToe\)"),
])
def test_a_game_the_run_cannot_play_is_a_one_line_error_of_the_config(game, options, message):
    with pytest.raises(ValueError, match=message):
        TextArenaConfig(kind="textarena", game=game, split="train", num_samples=2, options=options)


def test_the_recipe_with_an_unknown_game_fails_in_one_line_before_ray_starts():
    import os

    from nemo_like.config import ConfigError, load_config

    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "configs", "grpo_textarena_tiny.yaml")
    assert load_config(recipe, []).data.train.generator.game == "GuessTheNumber-v0"
    with pytest.raises(ConfigError) as e:
        load_config(recipe, ["data.validation.generator.game=GuesTheNumber-v0"])
    assert str(e.value).count("\n") == 0 and "did you mean 'GuessTheNumber-v0'" in str(e.value)
    assert "data.validation.generator" in str(e.value)  # from the config alone: no Ray, no model


def test_rows_are_episodes_whose_prompt_is_the_first_observation_and_splits_never_share_a_seed():
    train = _rows("GuessTheNumber-v0", "train", 40, seed=3, max_number=50)
    val = _rows("GuessTheNumber-v0", "validation", 40, seed=3, max_number=50)
    assert {r["ta_seed"] for r in train}.isdisjoint({r["ta_seed"] for r in val})
    assert len({r["ta_seed"] for r in train}) == 40 and all(r["ta_seed"] % 2 == 0 for r in train)
    assert [r["ta_seed"] for r in val[:2]] == [episode_seed("validation", 3, 0), episode_seed("validation", 3, 1)]
    first = train[0]
    assert "between 1 and 50" in first["problem"] and first["expected_answer"] == ""
    assert first["ta_game"] == "GuessTheNumber-v0" and first["ta_options"] == '{"max_number": 50}'
    assert _rows("GuessTheNumber-v0", "train", 40, seed=3, max_number=50) == train  # deterministic
    # A row's seed rebuilds the same game (the same secret number); the seeds make different games.
    def target(seed: int) -> int:
        session = GameSession("GuessTheNumber-v0", {"max_number": 50}, seed)
        session.start()
        return session.base.game_number

    assert [target(r["ta_seed"]) for r in train[:10]] == [target(r["ta_seed"]) for r in train[:10]]
    assert len({target(r["ta_seed"]) for r in train}) > 10


def test_building_games_leaves_the_callers_random_stream_alone():
    import random

    random.seed(123)
    expected = [random.random() for _ in range(3)]
    random.seed(123)
    _rows("Minesweeper-v0-small", "train", 3)
    env = TextArenaEnvironment({})
    row = _rows("GuessTheNumber-v0", "train", 1)[0]
    env.step([_log(row, "[10]")], [_meta(row)])
    assert [random.random() for _ in range(3)] == expected


@pytest.mark.parametrize("text, fmt, move", [
    ("7", "wrap", "[7]"), ("I guess [7]", "wrap", "I guess [7]"),
    ("e.g. [5]; my guess: [12]", "last", "[12]"), ("12", "last", "[12]"), (" 12 ", "raw", "12"),
    ("x" * 50, "wrap", "[" + "x" * 18 + "]"), ("\\boxed{3} so \\boxed{ 12 }", "boxed", "[12]"), ("12", "boxed", "[12]"),
])
def test_the_move_is_taken_from_the_text_as_configured(text, fmt, move):
    assert extract_move(text, fmt, 20) == move


# -------------------------------------------------------------------------------------- the episodes
def _binary_search(env: TextArenaEnvironment, row: dict, lo: int = 1, hi: int = 20) -> tuple[list, object]:
    moves: list[str] = []
    while True:
        guess = (lo + hi) // 2
        moves.append(str(guess))
        ret = env.step([_log(row, *moves)], [_meta(row)])
        if bool(ret.terminateds[0]):
            return moves, ret
        assert float(ret.rewards[0]) == 0.0 and ret.observations[0]["role"] == "user"
        hint = ret.observations[0]["content"]
        assert hint in ("The target number is higher.", "The target number is lower.")
        lo, hi = (guess + 1, hi) if "higher" in hint else (lo, guess - 1)


def test_a_single_player_game_is_played_to_a_win_from_the_log_alone():
    env = TextArenaEnvironment({})
    for row in _rows("GuessTheNumber-v0", "validation", 3):
        moves, ret = _binary_search(env, row)
        assert 1 <= len(moves) <= 5
        assert float(ret.rewards[0]) == 1.0 and ret.metrics["num_wins"] == 1.0 and ret.metrics["win_rate"] == 1.0
        assert "Congratulations" in ret.observations[0]["content"]
        # A fresh environment (a restarted actor) answers the same log the same way: the state is the log.
        again = TextArenaEnvironment({}).step([_log(row, *moves[:-1])], [_meta(row)]) if len(moves) > 1 else None
        if again is not None:
            assert not bool(again.terminateds[0])


def test_an_illegal_move_is_the_games_own_rule_a_warning_then_a_loss():
    env = TextArenaEnvironment({})
    row = _rows("GuessTheNumber-v0", "train", 1)[0]
    ret = env.step([_log(row, "[10]", "no idea")], [_meta(row)])
    assert not bool(ret.terminateds[0]) and ret.metrics["num_invalid_moves"] == 1.0
    assert "You attempted an invalid move" in ret.observations[0]["content"]
    ret = env.step([_log(row, "[10]", "no idea", "still none")], [_meta(row)])
    assert bool(ret.terminateds[0]) and ret.metrics["num_invalid_moves"] == 1.0
    # GuessTheNumber's loss: partial credit by how close the last valid guess was (1 - |10 - n| / 19).
    session = GameSession("GuessTheNumber-v0", {}, row["ta_seed"])
    session.start()
    target = session.base.game_number
    assert float(ret.rewards[0]) == pytest.approx(1 - abs(10 - target) / 19)
    assert ret.metrics["num_wins"] == 0.0 and ret.metrics["win_rate"] == 0.0


def test_two_player_games_against_the_scripted_opponents():
    row = _rows("TicTacToe-v0", "train", 1)[0]
    first = TextArenaEnvironment({"opponent": "first"})
    # The "first" opponent takes the lowest free cell: 0, 1, 2 while the model fills 4, 5 ... then 3: O wins 3-4-5.
    ret = first.step([_log(row, "[4]")], [_meta(row)])
    obs = ret.observations[0]["content"]
    assert "[Player 1] [0]" in obs and obs.count("Current Board") == 1  # only the latest board
    ret = first.step([_log(row, "[4]", "[5]", "[3]")], [_meta(row)])
    assert bool(ret.terminateds[0]) and float(ret.rewards[0]) == 1.0
    # The model loses when it lets the opponent complete 0-1-2.
    ret = first.step([_log(row, "[4]", "[8]", "[7]")], [_meta(row)])
    assert bool(ret.terminateds[0]) and float(ret.rewards[0]) == -1.0 and ret.metrics["win_rate"] == 0.0
    # The random opponent replies the same way to the same log (its draws are seeded by the episode).
    rand = TextArenaEnvironment({"opponent": "random"})
    nim = _rows("Nim-v0", "validation", 4)
    replies = [rand.step([_log(r, "[0 1]")], [_meta(r)]).observations[0]["content"] for r in nim]
    assert replies == [TextArenaEnvironment({}).step([_log(r, "[0 1]")], [_meta(r)]).observations[0]["content"]
                       for r in nim]
    assert all(re.search(r"\[Player 1\] \[\d \d\]", o) for o in replies)
    c4 = _rows("ConnectFour-v0", "train", 1)[0]
    ret = rand.step([_log(c4, "[col 3]", "[col 3]")], [_meta(c4)])
    assert not bool(ret.terminateds[0]) and ret.observations[0]["content"].count("[Player 1]") == 1


def test_a_game_that_raises_costs_only_its_sample_and_is_reported_once(capsys):
    import textarena as ta
    from textarena.envs.registration import ENV_REGISTRY

    class Crashes(ta.Env):  # a game with a bug on some input: the fault this test injects
        def reset(self, num_players, seed=None):
            self.state = ta.SinglePlayerState(num_players=num_players, seed=seed)
            self.state.reset(game_state={}, player_prompt_function=lambda **_: "Say anything.")

        def step(self, action):
            if "boom" in action:
                raise KeyError("board")
            return self.state.step()

    ta.register("NlCrashes-v0", entry_point=Crashes)
    try:
        row = _rows("NlCrashes-v0", "train", 1)[0]
        good = _rows("GuessTheNumber-v0", "train", 1)[0]
        env = TextArenaEnvironment({})
        logs = [_log(row, "boom"), _log(good, "[10]"), _log(row, "fine", "boom"), [{"role": "user"}], "junk"]
        metas = [_meta(row), _meta(good), _meta(row), _meta(good), None]
        ret = env.step(logs, metas)
        assert math.isnan(float(ret.rewards[0])) and math.isnan(float(ret.rewards[2]))
        assert bool(ret.terminateds[0]) and bool(ret.terminateds[2])
        assert not bool(ret.terminateds[1]) and float(ret.rewards[1]) == 0.0  # the good game goes on
        # Malformed samples are unscorable too (0 would be a real score in a -1..1 game), and counted apart.
        assert all(math.isnan(float(r)) for r in ret.rewards[3:]) and all(bool(t) for t in ret.terminateds[3:])
        assert ret.metrics["num_game_errors"] == 2.0 and ret.metrics["num_failures"] == 2.0
        env.step(logs[:1], metas[:1])
        out = capsys.readouterr().out
        assert out.count("raised KeyError: 'board'") == 1 and "'NlCrashes-v0'" in out and "unscorable" in out
    finally:
        ENV_REGISTRY.pop("NlCrashes-v0", None)


def test_only_textarena_rows_are_graded_here():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="needs rows from generator: {kind: textarena"):
        TextArenaEnvironment.check_dataset(SimpleNamespace(generator=None), None)
    with pytest.raises(ValueError, match=r"env.textarena.move_format"):
        TextArenaEnvironment({"move_format": "first"})
