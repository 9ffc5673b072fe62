"""Atomic, verified, locked, pruned checkpoint directories: ``<checkpoint_dir>/step_<N>/``.

Protocol (a crash at any point, kill -9 included, never leaves a directory that looks complete):
  0. the run takes ``mgr.lock()``: one live run per checkpoint_dir; leftovers of a crashed save go
  1. ``path = mgr.init_tmp_checkpoint(step, training_info)`` -> ``<checkpoint_dir>/tmp_step_<N>/``
  2. the caller writes whatever it needs inside (``policy/``, ``train_state.pt``, ...)
  3. ``mgr.finalize_checkpoint(path)`` fsyncs, writes ``training_info.json``, then ``manifest.json``
     (every file's size, sha256 of small ones) last, renames the directory to ``step_<N>`` and prunes.
Only ``step_<N>`` directories whose files match their manifest are used; the newest of them is
the one to resume, and newer damaged ones are skipped with a warning naming what is wrong. A
``tmp_*`` directory is always an unfinished (or crashed) save or delete.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nemo_like.utils.checkpoint_io import (
    MANIFEST,
    CheckpointError,
    checkpoint_problems,
    fsync_path,
    load_train_state,
    reached,
    read_manifest,
    restore_rng,
    save_train_state,
    verify_checkpoint,
    write_manifest,
)
from nemo_like.utils.dir_lock import LOCK_FILE, DirLock, DirLockedError

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointingConfig", "DirLockedError", "load_train_state",
           "preflight_checkpoints", "resume_wanted",
           "ranked_training_info", "training_info",
           "restore_rng", "save_train_state", "verify_checkpoint"]

TRAINING_INFO = "training_info.json"
# Written at init time so finalize (possibly from another manager instance) knows the info.
_PENDING_INFO = ".pending_training_info.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_STEP_RE = re.compile(r"^tmp_step_(\d+)$")
_TMP_OLD_RE = re.compile(r"^tmp_old_step_(\d+)$")
# Newer checkpoints than the one a run resumed from that failed verification: kept for a look,
# never loaded, never pruned.
_SET_ASIDE = "invalid_step_{}"
# An earlier run's checkpoints, moved aside by a run that starts fresh in the same checkpoint_dir.
_PREVIOUS = "previous_{}"
_PREVIOUS_RE = re.compile(r"^previous_\d+$")


class CheckpointingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Save checkpoints, and resume from the latest one in checkpoint_dir at start.
    enabled: bool = True
    # Folder of the run's step_<N> checkpoints; locked while a run uses it.
    checkpoint_dir: str = "results/checkpoints"
    # "auto": continue the newest checkpoint in checkpoint_dir when it is this run's (same model, data and
    # recipe) and refuse, saying how to start fresh, when it is another run's; true: continue, and refuse
    # when there is nothing to continue; false: start fresh, the earlier run's checkpoints moved (never
    # deleted) to <checkpoint_dir>/previous_<N>/.
    resume: bool | Literal["auto"] = "auto"
    # Save every this many steps, and after the last step (and when a run stops early).
    save_period: int = Field(10, gt=0)
    # None keeps every checkpoint; the latest checkpoint is always kept in addition to the top k.
    keep_top_k: int | None = Field(3, ge=1)
    # Looked up in training_info[metric_name], then training_info["metrics"][metric_name].
    # None ranks checkpoints by recency only.
    metric_name: str | None = "val/accuracy"
    # Direction of metric_name when checkpoints are ranked (False for a loss).
    higher_is_better: bool = True

    @field_validator("checkpoint_dir", mode="before")
    @classmethod
    def _fspath(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value


def training_info(step: int, *metric_dicts: Mapping[str, Any] | None) -> dict[str, Any]:
    """``training_info`` for :meth:`CheckpointManager.init_tmp_checkpoint`: the step and the merged
    metrics (later dicts win). It is strict JSON, so a NaN metric (a loss over zero tokens) is left out."""
    merged: dict[str, Any] = {}
    for d in metric_dicts:
        merged.update(d or {})
    return {"step": int(step), "metrics": {k: float(v) for k, v in merged.items()
                                           if isinstance(v, (int, float)) and math.isfinite(v)}}


def ranked_training_info(step: int, val_metrics: Mapping[str, Any] | None, val_step: int,
                         *metric_dicts: Mapping[str, Any] | None) -> dict[str, Any]:
    """:func:`training_info` for a trainer's save: the validation metrics only when they were measured
    at this step (``val_step``), so a checkpoint is ranked by its own weights' score; an earlier
    step's would make an unvalidated or collapsed checkpoint look best (and win ties as the newer)."""
    return training_info(step, val_metrics if val_step == step else None, *metric_dicts)


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    return int(step)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def _write_json_durable(path: Path, data: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


class CheckpointManager:
    """Creates, finalizes, verifies, finds and prunes checkpoints under ``cfg.checkpoint_dir``.

    A run that writes checkpoints holds the directory's lock (``lock()`` ... ``release_lock()``);
    saving without it is allowed only while no other live process holds it. On construction,
    leftovers of a crashed save are cleaned up (``remove_stale_tmp``) unless ``cleanup_stale=False``
    or a live run holds the lock (its save in progress is not a leftover).
    """

    def __init__(self, cfg: CheckpointingConfig | Mapping[str, Any], cleanup_stale: bool = True):
        self.cfg = cfg if isinstance(cfg, CheckpointingConfig) else CheckpointingConfig.model_validate(cfg)
        self.checkpoint_dir = Path(self.cfg.checkpoint_dir)
        self._lock = DirLock(self.checkpoint_dir, label=f"checkpointing.checkpoint_dir={self.checkpoint_dir}")
        if cleanup_stale and self.checkpoint_dir.is_dir():
            try:  # under the lock, taken for the moment: never while another run may be saving
                self._lock.acquire()
            except DirLockedError:
                return
            try:
                self.remove_stale_tmp()
            finally:
                self._lock.release()

    # ---------------------------------------------------------------- locking
    def lock(self) -> CheckpointManager:
        """Takes the directory for this run (DirLockedError naming the live holder otherwise), then
        clears what a crashed save left behind."""
        self._lock.acquire()
        self.remove_stale_tmp()
        return self

    def release_lock(self) -> None:
        self._lock.release()

    def check_unlocked(self) -> None:
        """DirLockedError when another live run holds the directory; takes nothing."""
        self._lock.check_free()

    def preflight(self, resume: bool = True) -> Path | None:
        """What a run checks before starting anything: DirLockedError when a live run holds the
        directory; with ``resume``, the checkpoint it would continue (CheckpointError if none is intact)."""
        self.check_unlocked()
        return self.get_latest_checkpoint_path() if resume else None

    def open_for_run(self, resume: bool = True) -> Path | None:
        """Takes the directory for the run (``lock()``); with ``resume``, returns ``resume_path()``;
        without, an earlier run's checkpoints are moved aside (``set_aside_run``): a fresh run never
        mixes its step_<N> folders (and their ranking) with another run's."""
        self.lock()
        if resume:
            return self.resume_path()
        self.set_aside_run()
        return None

    def set_aside_run(self) -> Path | None:
        """Moves everything an earlier run left in checkpoint_dir (its step_<N> folders, damaged ones,
        files beside them) into ``previous_<N>/`` (the first free N); returns that folder, or None when
        there was nothing. Needs the lock."""
        if not self._lock.held:
            raise RuntimeError("CheckpointManager.set_aside_run() needs lock() first")
        if not self.checkpoint_dir.is_dir():
            return None
        leftovers = [c for c in sorted(self.checkpoint_dir.iterdir())
                     if c.name != LOCK_FILE and not _PREVIOUS_RE.match(c.name)]
        if not leftovers:
            return None
        n = 1
        while (self.checkpoint_dir / _PREVIOUS.format(n)).exists():
            n += 1
        aside = self.checkpoint_dir / _PREVIOUS.format(n)
        aside.mkdir()
        for child in leftovers:
            os.replace(child, aside / child.name)
        fsync_path(self.checkpoint_dir)
        print(f"[nemo_like] checkpointing.resume=false: the earlier run's checkpoints in {self.checkpoint_dir} "
              f"moved to {aside}")
        return aside

    # ----------------------------------------------------------------- saving
    def should_save(self, step: int, is_last_step: bool = False) -> bool:
        """True when checkpointing is enabled and ``step`` is a save step (or the final one)."""
        return self.cfg.enabled and (is_last_step or _check_step(step) % self.cfg.save_period == 0)

    def init_tmp_checkpoint(self, step: int, training_info: Mapping[str, Any] | None = None) -> Path:
        step = _check_step(step)
        info = dict(training_info or {})
        if "step" in info and info["step"] != step:
            raise ValueError(f"training_info['step']={info['step']!r} disagrees with checkpoint step {step}")
        info["step"] = step
        try:
            json.dumps(info, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"training_info for step {step} must be JSON-serialisable (finite numbers): {e}") from e

        self.check_unlocked()
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint_dir / f"tmp_step_{step}"
        if tmp.exists():  # left over from a crash during an earlier save of this step
            shutil.rmtree(tmp)
        tmp.mkdir()
        _write_json_durable(tmp / _PENDING_INFO, info)
        reached("init")
        return tmp

    def finalize_checkpoint(self, tmp_path: str | os.PathLike[str]) -> Path:
        """Makes the save visible as ``step_<N>`` atomically, then prunes; returns the final path."""
        tmp = Path(tmp_path)
        m = _TMP_STEP_RE.match(tmp.name)
        if m is None or tmp.parent.resolve() != self.checkpoint_dir.resolve():
            raise ValueError(
                f"{tmp} is not a temporary checkpoint of this manager (expected "
                f"{self.checkpoint_dir}/tmp_step_<N> from init_tmp_checkpoint)"
            )
        pending = tmp / _PENDING_INFO
        if not pending.is_file():
            raise FileNotFoundError(f"{pending} is missing: was {tmp} created by init_tmp_checkpoint?")
        self.check_unlocked()
        info = json.loads(pending.read_text(encoding="utf-8"))
        step = int(m.group(1))

        # Everything the caller wrote must be on disk before the manifest vouches for it.
        _fsync_tree(tmp)
        reached("info")
        _write_json_durable(tmp / TRAINING_INFO, info)
        pending.unlink()
        reached("manifest")
        write_manifest(tmp, step)
        reached("rename")

        final = self.checkpoint_dir / f"step_{step}"
        old = self.checkpoint_dir / f"tmp_old_step_{step}"
        if final.exists():
            # os.replace cannot overwrite a non-empty directory: move the old one aside first.
            # A crash between the two renames leaves tmp_old_step_<N>, which remove_stale_tmp restores.
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
            reached("replace")
        os.replace(tmp, final)
        fsync_path(self.checkpoint_dir)
        if old.exists():
            shutil.rmtree(old)
        reached("prune")
        self.prune(keep_step=step)
        return final

    # ---------------------------------------------------------------- finding
    def _step_dirs(self) -> list[tuple[int, Path]]:
        """Every ``step_<N>`` directory, complete or not, oldest first. A ``tmp_old_step_<N>`` without
        its ``step_<N>`` (a crash between the renames of a re-save) stands in for it until a run
        holding the lock puts it back."""
        if not self.checkpoint_dir.is_dir():
            return []
        found: dict[int, Path] = {}
        for child in sorted(self.checkpoint_dir.iterdir(), key=lambda c: not _STEP_RE.match(c.name)):
            m = _STEP_RE.match(child.name) or _TMP_OLD_RE.match(child.name)
            if m and child.is_dir():
                found.setdefault(int(m.group(1)), child)
        return sorted(found.items())

    def _finalized(self) -> list[tuple[int, Path]]:
        # Cheap (no hashing): what a finished save looks like. Loading verifies the files themselves.
        return [(step, path) for step, path in self._step_dirs() if (path / MANIFEST).is_file()]

    def list_checkpoints(self) -> list[Path]:
        """Finalized checkpoints (those with a manifest), oldest first."""
        return [path for _step, path in self._finalized()]

    def problems(self, path: str | os.PathLike[str]) -> list[str]:
        """What is wrong with the checkpoint at ``path``; empty when its files match its manifest."""
        path = Path(path)
        problems = checkpoint_problems(path)
        m = _STEP_RE.match(path.name) or _TMP_OLD_RE.match(path.name)
        if not problems and m:
            saved = read_manifest(path).get("step")
            if saved != int(m.group(1)):
                problems.append(f"its manifest is for step {saved}")
        return problems

    def _first_valid(self, ordered: list[tuple[int, Path]], what: str) -> Path | None:
        """The first intact checkpoint of ``ordered``, warning about each damaged one before it;
        CheckpointError naming every problem when none is intact."""
        if not ordered:
            return None
        skipped = []
        for _step, path in ordered:
            problems = self.problems(path)
            if not problems:
                for name, why in skipped:
                    warnings.warn(f"{self.checkpoint_dir}: skipping checkpoint {name} ({why}); "
                                  f"using {path.name}, the {what} intact one", stacklevel=3)
                return path
            skipped.append((path.name, "; ".join(problems)))
        listed = "; ".join(f"{name}: {why}" for name, why in skipped)
        raise CheckpointError(f"checkpointing.checkpoint_dir={self.checkpoint_dir} holds no intact checkpoint "
                              f"({listed}); repair or delete them, or use another checkpoint_dir")

    def get_latest_checkpoint_path(self) -> Path | None:
        """The newest checkpoint whose files match its manifest (damaged newer ones are skipped with a
        warning); None when there is no checkpoint; CheckpointError when none of them is intact."""
        return self._first_valid(self._step_dirs()[::-1], "newest")

    def resume_path(self) -> Path | None:
        """``get_latest_checkpoint_path()``, and the damaged checkpoints newer than it set aside as
        ``invalid_step_<N>``: the resumed run saves those steps again. Needs the lock."""
        if not self._lock.held:
            raise RuntimeError("CheckpointManager.resume_path() needs lock() first")
        latest = self.get_latest_checkpoint_path()
        m = None if latest is None else (_STEP_RE.match(latest.name) or _TMP_OLD_RE.match(latest.name))
        newest = -1 if m is None else int(m.group(1))
        for step, path in self._step_dirs():
            if step > newest:
                aside = self.checkpoint_dir / _SET_ASIDE.format(step)
                if aside.exists():
                    shutil.rmtree(aside)
                os.replace(path, aside)
                warnings.warn(f"{path} is damaged; moved to {aside.name}", stacklevel=2)
        return latest

    def _metric_of(self, path: Path) -> float | None:
        name = self.cfg.metric_name
        if name is None:
            return None
        try:
            info = self.load_training_info(path)
        except (OSError, ValueError):
            return None
        value = info.get(name)
        if value is None and isinstance(info.get("metrics"), Mapping):
            value = info["metrics"].get(name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            return None
        return float(value)

    def _ranked(self) -> list[tuple[int, Path]]:
        """Best first: having the metric beats missing it, then metric value, then newer step."""
        sign = 1.0 if self.cfg.higher_is_better else -1.0

        def key(item: tuple[int, Path]) -> tuple[int, float, int]:
            metric = self._metric_of(item[1])
            return (metric is not None, sign * metric if metric is not None else 0.0, item[0])

        return sorted(self._finalized(), key=key, reverse=True)

    def get_best_checkpoint_path(self) -> Path | None:
        """Best intact one by ``metric_name`` (ties -> newer); the latest when none has the metric."""
        return self._first_valid(self._ranked(), "best")

    @staticmethod
    def load_training_info(path: str | os.PathLike[str]) -> dict[str, Any]:
        path = Path(path)
        file = path / TRAINING_INFO if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no {TRAINING_INFO} in {path}: not a finalized checkpoint")
        try:
            info = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}:{e.lineno}: malformed JSON: {e.msg}") from e
        if not isinstance(info, dict):
            raise ValueError(f"{file}: expected a JSON object, got {type(info).__name__}")
        return info

    # ---------------------------------------------------------------- cleanup
    def prune(self, keep_step: int | None = None) -> list[Path]:
        """Deletes checkpoints outside the top ``keep_top_k``; returns them. ``keep_step`` (default: the
        newest) is kept in any case: the save just made, never a damaged newer one."""
        k = self.cfg.keep_top_k
        ckpts = self._finalized()
        if k is None or len(ckpts) <= k:
            return []
        self.check_unlocked()
        keep = {step for step, _ in self._ranked()[:k]} | {ckpts[-1][0] if keep_step is None else keep_step}
        removed = []
        for step, path in ckpts:
            if step not in keep:
                # One rename first: a crash while deleting leaves a tmp_* directory, never a half checkpoint.
                doomed = self.checkpoint_dir / f"tmp_del_step_{step}"
                if doomed.exists():
                    shutil.rmtree(doomed)
                os.replace(path, doomed)
                reached("delete")
                shutil.rmtree(doomed)
                removed.append(path)
        return removed

    def remove_stale_tmp(self) -> list[Path]:
        """Removes leftovers of interrupted saves and deletes; restores a step_<N> that a crash left
        moved aside."""
        if not self.checkpoint_dir.is_dir():
            return []
        self.check_unlocked()
        removed = []
        for child in sorted(self.checkpoint_dir.iterdir()):
            m = _TMP_OLD_RE.match(child.name)
            if m:
                final = self.checkpoint_dir / f"step_{m.group(1)}"
                if not final.exists() and (child / MANIFEST).is_file():
                    os.replace(child, final)
                    continue
            if child.name.startswith("tmp_") and child.is_dir():
                shutil.rmtree(child)
                removed.append(child)
        return removed


def resume_wanted(config: CheckpointingConfig, resume: bool | None = None) -> bool:
    """Whether a run looks for a checkpoint to continue: ``resume`` when the caller says (the notebook
    API's argument), else ``checkpointing.resume`` ("auto" looks; what it finds is then checked)."""
    return bool(config.resume) if resume is None else bool(resume)


def preflight_checkpoints(config: CheckpointingConfig, resume: bool | None = None
                          ) -> tuple[CheckpointManager | None, Path | None]:
    """A run's checkpoint directory checked before anything starts: its manager (None with
    checkpointing off) and, when it resumes (``resume_wanted``), the checkpoint the run would continue
    (None: a new run). Raises what ``CheckpointManager.preflight`` raises (a live run's lock, only
    damaged checkpoints), and CheckpointError for ``checkpointing.resume: true`` with nothing to continue."""
    if not config.enabled:
        return None, None
    ckpt = CheckpointManager(config, cleanup_stale=False)
    wanted = resume_wanted(config, resume)
    latest = ckpt.preflight(wanted)
    if resume is None and config.resume is True and latest is None:
        raise CheckpointError(f"checkpointing.resume=true, but checkpointing.checkpoint_dir={config.checkpoint_dir} "
                              "holds no checkpoint to continue; set checkpointing.resume=auto (or false) to "
                              "start a new run")
    return ckpt, latest

