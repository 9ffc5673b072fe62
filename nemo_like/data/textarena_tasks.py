"""TextArena games as a task source (``generator: {kind: textarena, ...}``): one row per episode.

`TextArena <https://github.com/LeonGuertler/TextArena>`_ (PyPI ``textarena``) registers several hundred
text games under ids such as ``GuessTheNumber-v0`` or ``TicTacToe-v0``. A dataset config names one game
and its own keyword options::

    generator: {kind: textarena, game: GuessTheNumber-v0, split: train, num_samples: 2000, seed: 1,
                options: {max_number: 50}}

Each row is one episode: ``problem`` is the game's first observation for the model's player (the
prompt-only processor renders it as the first user turn), and ``ta_game``, ``ta_options`` (JSON) and
``ta_seed`` rebuild the very game in the ``textarena`` environment, which plays it turn by turn.

Train and validation never share a game seed: train rows get even seeds, validation rows odd ones,
whatever ``seed`` each config sets. (A game with few distinct starts, such as guessing a number in
1..20, still repeats its starts across seeds and splits: only the seeds are disjoint.)

This module also holds what the environment needs to play a game (:class:`GameSession`), so the rows
and the environment build games the same way. textarena is imported only when a game is used.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import json
import random
import re
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_like.data.errors import DataError

__all__ = ["TextArenaConfig", "generate_textarena_dataset", "GameSession", "OPPONENTS", "MODEL_PLAYER",
           "game_ids", "check_game", "episode_seed", "scripted_opponent_games"]

MODEL_PLAYER = 0  # the seat the model plays; every supported game lets player 0 move first
# Why rows hold seeds far apart: a config's seed picks a block of episode seeds of its own.
_SEED_BLOCK = 1_000_000
# An opponent that keeps making moves the game refuses (a scripted one never should) ends the game as
# an error after this many, instead of looping.
_MAX_OPPONENT_TRIES = 20


# ------------------------------------------------------------------------------------- the library
def import_textarena() -> Any:
    try:
        import textarena
    except ImportError as e:
        raise DataError(f"textarena is not installed ({e}): `uv sync --extra textarena` (or `uv pip install "
                        "textarena`)") from e
    return textarena


def _registry() -> dict[str, Any]:
    return import_textarena().envs.registration.ENV_REGISTRY


def game_ids() -> list[str]:
    """Every game id TextArena registers, sorted."""
    return sorted(_registry())


@contextlib.contextmanager
def _own_random_state() -> Iterator[None]:
    """TextArena seeds the process-wide ``random`` module on every reset (``random.seed(seed)``): the
    caller's random stream is put back afterwards, so building a game never changes anyone else's draws."""
    saved = random.getstate()
    try:
        yield
    finally:
        random.setstate(saved)


def _base_env(env: Any) -> Any:
    ta = import_textarena()
    while isinstance(env, ta.Wrapper):
        env = env.env
    return env


# ------------------------------------------------------------------------------ scripted opponents
def _tictactoe_moves(gs: dict) -> list[str]:
    return [f"[{r * 3 + c}]" for r in range(3) for c in range(3) if gs["board"][r][c] == ""]


def _nim_moves(gs: dict) -> list[str]:
    return [f"[{i} {q}]" for i, pile in enumerate(gs["piles"]) for q in range(1, pile + 1)]


def _connect_four_moves(gs: dict) -> list[str]:
    return [f"[col {c}]" for c, cell in enumerate(gs["board"][0]) if cell == "."]


# The legal moves of a two-player game, read from its game state; keyed by the game's class name, so
# every registered variant of a game (Nim-v0-large, ConnectFour-v0-blind, ...) has its opponent.
_LEGAL_MOVES: dict[str, Callable[[dict], list[str]]] = {
    "TicTacToeEnv": _tictactoe_moves, "NimEnv": _nim_moves, "ConnectFourEnv": _connect_four_moves}

# Scripted opponents: ``random`` plays a uniformly drawn legal move (its generator seeded by the
# episode's seed, so a replayed episode meets the same replies), ``first`` the first legal move.
OPPONENTS = ("random", "first")


def scripted_opponent_games() -> list[str]:
    """Class names of the two-player games a scripted opponent can play."""
    return sorted(_LEGAL_MOVES)


# ------------------------------------------------------------------------------------- one episode
def _format(messages: list[tuple[int, str, Any]]) -> str:
    """A player's new observations as one user turn: the game's messages as they are, the opponent's
    moves labelled, only the latest board; the model's own moves, echoed back by the game, are left out
    (they are its last assistant turn already)."""
    ta = import_textarena()
    boards = [i for i, (_, _, kind) in enumerate(messages) if kind == ta.ObservationType.GAME_BOARD]
    lines = []
    for i, (sender, text, kind) in enumerate(messages):
        if sender == MODEL_PLAYER and kind == ta.ObservationType.PLAYER_ACTION:
            continue
        if kind == ta.ObservationType.GAME_BOARD and i != boards[-1]:
            continue  # a board drawn after the model's move and again after the reply: the latest one is enough
        text = str(text).strip()
        if text:
            lines.append(text if sender == ta.GAME_ID else f"[Player {sender}] {text}")
    return "\n".join(lines)


class GameSession:
    """One episode of ``game`` with ``options`` started from ``seed``, the model playing player 0 and,
    in a two-player game, a scripted ``opponent`` the other seat. Not thread-safe: TextArena draws from
    the process-wide ``random`` module, which every call here seeds and restores."""

    def __init__(self, game: str, options: dict[str, Any], seed: int, opponent: str = "random") -> None:
        ta = import_textarena()
        with _own_random_state():
            self.env = ta.make(game, **options)
        self.base = _base_env(self.env)
        self.game, self.seed = game, int(seed)
        self.opponent = opponent
        self.rng = random.Random(self.seed * 7919 + 17)  # the opponent's own stream, apart from the game's
        self.num_players = 0
        self.done = False
        self.invalid_moves = 0
        self._game_random: Any = None

    def start(self) -> str:
        """Reset the game; the model's first observation. Tries one player, then two: a game's state
        refuses a number of players it is not made for (an AssertionError)."""
        with _own_random_state():
            last: Exception | None = None
            for n in (1, 2):
                try:
                    self.base.reset(num_players=n, seed=self.seed)
                except AssertionError as e:
                    last = e
                    continue
                self.num_players = n
                break
            else:
                raise ValueError(f"{self.game} is not a one- or two-player game ({last})")
            if self.num_players == 2 and type(self.base).__name__ not in _LEGAL_MOVES:
                raise ValueError(f"{self.game} is a two-player game without a scripted opponent here (games with one: "
                                 f"{', '.join(n.removesuffix('Env') for n in scripted_opponent_games())})")
            if self.base.state.current_player_id != MODEL_PLAYER:
                raise ValueError(f"{self.game}: player {MODEL_PLAYER} does not move first")
            self._game_random = random.getstate()  # the game's stream, carried from call to call
            return self._observe()

    def _observe(self) -> str:
        player, messages = self.base.get_observation()
        if player != MODEL_PLAYER:
            raise RuntimeError(f"it is player {player}'s turn, not the model's")
        return _format(messages)

    def play(self, move: str) -> str | None:
        """The model's move; the game's answer (after the opponent's reply) as the model's next
        observation, or None when the game is over."""
        if self.done:
            raise RuntimeError("the game is already over")
        with _own_random_state():
            random.setstate(self._game_random)  # as if the game had run alone since its reset
            errors_before = getattr(self.base.state, "error_count", 0)
            done, _ = self.base.step(move)
            if getattr(self.base.state, "error_count", 0) > errors_before or self._lost_by_invalid():
                self.invalid_moves += 1
            if not done and self.num_players == 2:
                done = self._opponent_turns()
            self.done = bool(done)
            self._game_random = random.getstate()
            return None if self.done else self._observe()

    def _lost_by_invalid(self) -> bool:
        info = getattr(self.base.state, "game_info", {}) or {}
        return bool(self.base.state.done and info.get(MODEL_PLAYER, {}).get("invalid_move"))

    def _opponent_turns(self) -> bool:
        legal = _LEGAL_MOVES[type(self.base).__name__]
        for _ in range(_MAX_OPPONENT_TRIES):
            if self.base.state.done or self.base.state.current_player_id == MODEL_PLAYER:
                return bool(self.base.state.done)
            self.base.get_observation()  # the opponent's view: it plays from the game state instead
            moves = legal(self.base.state.game_state)
            if not moves:
                raise RuntimeError("the scripted opponent has no legal move")
            move = moves[0] if self.opponent == "first" else self.rng.choice(moves)
            done, _ = self.base.step(move)
            if done:
                return True
        raise RuntimeError(f"the scripted opponent made {_MAX_OPPONENT_TRIES} moves the game refused")

    def reward(self) -> float:
        """The model's reward once the game is over (TextArena's: e.g. 1 win, -1 loss, 0 draw)."""
        rewards = self.base.state.rewards or {}
        return float(rewards.get(MODEL_PLAYER, 0.0))

    def outcome(self) -> str:
        info = getattr(self.base.state, "game_info", {}) or {}
        return str(info.get(MODEL_PLAYER, {}).get("reason", ""))


# ------------------------------------------------------------------------------------------ config
def _did_you_mean(name: str, known: list[str], what: str) -> str:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    if not close:  # ids differ mostly by their version suffix: match the stem too
        stem = name.split("-")[0].lower()
        close = [k for k in known if k.lower().startswith(stem)][:3]
    return f"did you mean {' or '.join(repr(c) for c in close)}?" if close else f"see {what}"


def _option_names(game: str) -> list[str] | None:
    """The keyword options a game's class takes, None when they cannot be read."""
    spec = _registry()[game]
    entry = spec.entry_point
    try:
        if isinstance(entry, str):
            module, _, cls = entry.partition(":")
            import importlib

            entry = getattr(importlib.import_module(module), cls)
        params = inspect.signature(entry.__init__).parameters
    except Exception:
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return [n for n in params if n != "self"]


@lru_cache(maxsize=64)
def _check_game_cached(game: str, options_json: str) -> int:
    options = json.loads(options_json)
    known = game_ids()
    if game not in known:
        raise ValueError(f"game: TextArena has no game {game!r} "
                         f"({_did_you_mean(game, known, 'textarena.envs.registration.ENV_REGISTRY for the ids')})")
    names = _option_names(game)
    if names is not None:
        for key in options:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"did you mean options.{close[0]}?" if close else f"its options: {', '.join(names) or 'none'}"
                raise ValueError(f"options.{key}: not an option of TextArena's {game!r} ({hint})")
    try:
        session = GameSession(game, options, 0)
        session.start()
    except ValueError as e:
        raise ValueError(f"game: {e}") from None
    except Exception as e:  # a game that cannot start (missing data files, a bad option value)
        first = str(e).strip().splitlines()
        detail = next((ln.strip() for ln in first if ln.strip() and not ln.strip().startswith("*")), "")
        raise ValueError(f"game: TextArena's {game!r} (options {options}) could not start: "
                         f"{type(e).__name__}: {detail[:200]}") from None
    return session.num_players


def check_game(game: str, options: dict[str, Any] | None = None) -> int:
    """The number of players of ``game``; ``ValueError`` (one line, with a did-you-mean) when it is not a
    registered id, an option is not the game's, or the game cannot start with the model as player 0
    against a scripted opponent."""
    return _check_game_cached(game, json.dumps(options or {}, sort_keys=True))


class TextArenaConfig(BaseModel):
    """``data.<split>.generator`` for TextArena games: one row per episode, checked before Ray starts."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["textarena"]  # which generator this is
    # A TextArena game id, e.g. GuessTheNumber-v0, Minesweeper-v0-small, TicTacToe-v0 (two players: the
    # model is player 0, a scripted opponent player 1, env.textarena.opponent).
    game: str
    # The game's own keyword options (e.g. max_number for GuessTheNumber), checked against its class.
    options: dict[str, Any] = Field(default_factory=dict)
    # Which seeds: train rows get even game seeds, validation rows odd ones, so the splits never share one.
    split: Literal["train", "validation"]
    num_samples: int = Field(gt=0)  # episodes (rows)
    seed: int = Field(default=0, ge=0)  # picks the block of game seeds the rows use

    @model_validator(mode="after")
    def _check_game(self) -> TextArenaConfig:
        check_game(self.game, self.options)
        return self


def episode_seed(split: str, seed: int, index: int) -> int:
    """The game seed of row ``index``: even for train, odd for validation."""
    return 2 * (seed * _SEED_BLOCK + index) + (split == "validation")


def generate_textarena_dataset(cfg: TextArenaConfig) -> Any:
    """``num_samples`` episodes of ``cfg.game``: a ``datasets.Dataset`` with ``problem`` (the first
    observation), ``expected_answer`` (empty: the game grades), ``ta_game``, ``ta_options`` (JSON) and
    ``ta_seed``."""
    import datasets

    options_json = json.dumps(cfg.options, sort_keys=True)
    rows: dict[str, list] = {"problem": [], "expected_answer": [], "ta_game": [], "ta_options": [], "ta_seed": []}
    for i in range(cfg.num_samples):
        seed = episode_seed(cfg.split, cfg.seed, i)
        try:
            first = GameSession(cfg.game, cfg.options, seed).start()
        except Exception as e:  # a game bug on one seed: name it, not a traceback
            raise DataError(f"textarena game {cfg.game!r} (options {cfg.options}) failed to start with seed {seed}: "
                            f"{type(e).__name__}: {e}") from e
        rows["problem"].append(first)
        rows["expected_answer"].append("")
        rows["ta_game"].append(cfg.game)
        rows["ta_options"].append(options_json)
        rows["ta_seed"].append(seed)
    return datasets.Dataset.from_dict(rows)


_BRACKET = re.compile(r"\[[^\[\]]*\]")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def extract_move(text: str, move_format: str, max_chars: int) -> str:
    """The move the game is given from the model's text. ``wrap`` (TextArena's own default): the text,
    in brackets when it has none; ``last``: the last ``[...]`` in the text (a model that reasons first,
    quoting example moves, means its last one), else as ``wrap``; ``raw``: the text as it is (each game
    reads its own format, most the first ``[...]``); ``boxed``: what the last ``\\boxed{...}`` holds, in
    brackets (a model taught to box its answers), else as ``wrap``. Cut to ``max_chars`` either way."""
    text = text.strip()
    if move_format == "last":
        found = _BRACKET.findall(text)
        if found:
            return found[-1][:max_chars]
    if move_format == "boxed":
        boxed = _BOXED.findall(text)
        if boxed:
            text = boxed[-1].strip()
    if move_format in ("wrap", "last", "boxed") and "[" not in text and "]" not in text:
        return f"[{text[: max(max_chars - 2, 0)]}]"
    return text[:max_chars]
