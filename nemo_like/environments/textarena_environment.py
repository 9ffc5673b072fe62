"""TextArena games as multi-turn episodes: the ``textarena`` environment.

Rows come from :mod:`nemo_like.data.textarena_tasks` (``generator: {kind: textarena, ...}``): each names
a game, its options and a seed, and its prompt is the game's first observation. Every step takes the
model's last message as its move, and answers with the game's reply (after a scripted opponent's move
in a two-player game) as the next user turn; when the game ends, the episode terminates with the
game's own reward for the model (e.g. 1 for a win, -1 for a loss, 0 for a draw; GuessTheNumber gives
partial credit by how close the last guess was). Illegal moves are the game's: most games ask once
to resubmit and count a second illegal move in a row as a loss.

Where the state lives: nowhere but in the message log. Each step rebuilds the game from the row's
(game, options, seed) and replays every assistant move of the log, so the same log always gives the
same game. A restarted actor (Ray restarts a dead one) and a step that Ray retries (``max_task_retries``)
then continue the episode exactly, where a table of live games in the actor would lose every episode
in flight, or apply a retried move twice. Replaying costs a few game steps per turn: TextArena games
are small pure-Python state machines.

A game that raises (a bug on some input) costs only its sample: reward NaN (unscorable: out of the
baseline, no gradient), terminated, counted in ``num_game_errors``, the first error printed once.

This module imports neither torch nor textarena at import time.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from nemo_like.data.textarena_tasks import GameSession, extract_move
from nemo_like.environments.env_config import EnvConfig, validate_env_config
from nemo_like.environments.interfaces import EnvironmentInterface, EnvironmentReturn, normalize_step_inputs

if TYPE_CHECKING:
    from nemo_like.data.interfaces import LLMMessageLogType

__all__ = ["TextArenaEnvConfig", "TextArenaEnvironment"]

_ROW_KEYS = ("ta_game", "ta_options", "ta_seed")


class TextArenaEnvConfig(EnvConfig):
    """``env.textarena``: checked before Ray starts. ``step_timeout_s`` (from EnvConfig) bounds one step
    call, all its games together: past it the samples are unscorable and the actor restarted."""

    # The scripted player 1 of a two-player game: "random" (a uniformly drawn legal move, seeded by the
    # episode's seed) or "first" (the first legal move; deterministic).
    opponent: Literal["random", "first"] = "random"
    # How the move is taken from the model's message: "wrap" (TextArena's default: the text, put in
    # [brackets] when it has none), "last" (the last [...] in the text, for models that reason first),
    # "raw" (the text as it is; the game reads its own format), "boxed" (what the last \boxed{...} holds,
    # in brackets: for a model taught to box its answers, as the tiny default model is).
    move_format: Literal["wrap", "last", "raw", "boxed"] = "wrap"
    # A longer move is cut to this many characters before the game reads it.
    max_move_chars: int = Field(default=200, ge=1)


class _BadSample(Exception):
    pass


def _moves(message_log: Any) -> list[str]:
    if not isinstance(message_log, (list, tuple)):
        raise _BadSample(f"message log is a {type(message_log).__name__}, not a list")
    moves = []
    for m in message_log:
        if not isinstance(m, dict):
            raise _BadSample(f"message is a {type(m).__name__}, not a dict")
        if m.get("role") == "assistant":
            if not isinstance(m.get("content"), str):
                raise _BadSample("assistant content is not a string")
            moves.append(m["content"])
    if not moves:
        raise _BadSample("no assistant message")
    return moves


def _row(meta: Any) -> tuple[str, dict, int]:
    if not isinstance(meta, dict) or not all(k in meta for k in _ROW_KEYS):
        raise _BadSample(f"metadata lacks {', '.join(_ROW_KEYS)} (rows of generator kind textarena carry them)")
    try:
        options = json.loads(meta["ta_options"]) if isinstance(meta["ta_options"], str) else dict(meta["ta_options"])
        return str(meta["ta_game"]), options, int(meta["ta_seed"])
    except (TypeError, ValueError) as e:
        raise _BadSample(f"bad textarena row keys: {e}") from None


class TextArenaEnvironment(EnvironmentInterface):
    """Plays each sample's game up to its last assistant message (see the module docstring).

    Per sample: not over, observation ``{"role": "user", "content": <the game's reply>}``, reward 0;
    over, terminated with the game's reward for player 0. Metrics: ``num_terminated``, ``num_wins``
    (games over with reward >= 1), ``win_rate`` (their share of the games over; absent when none ended),
    ``num_invalid_moves`` (the last move of a sample, refused by the game), ``num_game_errors``
    (unscorable), ``num_failures`` (malformed samples: 0, terminated). Never raises from :meth:`step`.
    """

    config_model: ClassVar[type[EnvConfig]] = TextArenaEnvConfig
    # One step at a time: TextArena draws from the process-wide random module, swapped in per game.
    max_concurrent_steps: ClassVar[int] = 1

    @classmethod
    def check_dataset(cls, ds_cfg: Any, options: Any) -> None:
        """Rows graded here must come from the textarena generator (they carry the game and its seed)."""
        if getattr(ds_cfg.generator, "kind", None) != "textarena":
            raise ValueError("is graded by the textarena environment, which needs rows from "
                             "generator: {kind: textarena, game: ..., ...}")

    def __init__(self, config: dict | None = None) -> None:
        self.cfg = validate_env_config("textarena", TextArenaEnvConfig, config)
        self._error_shown = False

    def _play(self, message_log: Any, meta: Any) -> tuple[str | None, float, bool, str]:
        """(next observation or None when over, reward, last move refused, outcome)."""
        moves = _moves(message_log)
        game, options, seed = _row(meta)
        session = GameSession(game, options, seed, opponent=self.cfg.opponent)
        session.start()
        obs: str | None = None
        for k, text in enumerate(moves):
            if session.done:
                raise _BadSample(f"the log holds {len(moves)} moves, but the game ended after {k}")
            before = session.invalid_moves
            obs = session.play(extract_move(text, self.cfg.move_format, self.cfg.max_move_chars))
        refused = session.invalid_moves > before
        if obs is None:
            return None, session.reward(), refused, session.outcome()
        return obs, 0.0, refused, ""

    def step(self, message_log_batch: list[LLMMessageLogType], metadata: list[dict]) -> EnvironmentReturn:
        batch, meta = normalize_step_inputs(message_log_batch, metadata)
        n = len(batch)
        rewards, terminated = [0.0] * n, [True] * n
        observations: list[dict[str, str]] = [{"role": "user", "content": "Game over."} for _ in range(n)]
        counts = {"num_wins": 0, "num_invalid_moves": 0, "num_game_errors": 0, "num_failures": 0}
        over: list[float] = []
        for i in range(n):
            try:
                obs, reward, refused, outcome = self._play(batch[i], meta[i])
            except _BadSample as e:  # a malformed log or row: unscorable (0 is a real score in a -1..1 game)
                counts["num_failures"] += 1
                rewards[i] = float("nan")
                self._show_error(meta[i], e)
                continue
            except Exception as e:  # the game raised: this sample is unscorable, the others go on
                counts["num_game_errors"] += 1
                rewards[i] = float("nan")
                self._show_error(meta[i], e)
                continue
            counts["num_invalid_moves"] += refused
            if obs is None:
                rewards[i] = reward
                over.append(reward)
                counts["num_wins"] += reward >= 1.0
                observations[i] = {"role": "user", "content": f"Game over. {outcome}".strip()}
            else:
                terminated[i] = False
                observations[i] = {"role": "user", "content": obs}

        import torch  # lazily: config validation imports this module

        metrics = {k: float(v) for k, v in counts.items()}
        metrics["num_terminated"] = float(sum(terminated))
        if over:  # undefined when no game ended in this call (an average over turns must not see a 0)
            metrics["win_rate"] = counts["num_wins"] / len(over)
        return EnvironmentReturn(
            observations=observations,
            metadata=meta,
            next_stop_strings=[None] * n,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.tensor(terminated, dtype=torch.bool),
            metrics=metrics,
        )

    def _show_error(self, meta: Any, e: Exception) -> None:
        if self._error_shown:
            return
        self._error_shown = True
        where = f"{meta.get('ta_game')!r} (seed {meta.get('ta_seed')})" if isinstance(meta, dict) else "a game"
        first = (str(e).strip().splitlines() or [""])[0][:300]
        what = (f"a malformed sample: {first}" if isinstance(e, _BadSample) else
                f"{where} raised {type(e).__name__}: {first}")
        print(f"[nemo_like] textarena: {what}; the sample is unscorable (later ones are only counted, in "
              "env/<task>/num_game_errors and num_failures)", flush=True)
