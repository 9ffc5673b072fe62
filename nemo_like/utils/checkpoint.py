"""Atomic, pruned checkpoint directories: ``<checkpoint_dir>/step_<N>/``.

Protocol (a crash at any point never leaves a directory that looks complete):
  1. ``path = mgr.init_tmp_checkpoint(step, training_info)`` -> ``<checkpoint_dir>/tmp_step_<N>/``
  2. the caller writes whatever it needs inside (``policy/``, ``train_state.pt``, ...)
  3. ``mgr.finalize_checkpoint(path)`` writes ``training_info.json`` last, fsyncs, renames the
     directory to ``step_<N>`` and prunes old checkpoints.
Only ``step_<N>`` directories that contain ``training_info.json`` count as checkpoints; a
``tmp_*`` directory is always an unfinished (or crashed) save.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

TRAINING_INFO = "training_info.json"
# Written at init time so finalize (possibly from another manager instance) knows the info.
_PENDING_INFO = ".pending_training_info.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_STEP_RE = re.compile(r"^tmp_step_(\d+)$")
_TMP_OLD_RE = re.compile(r"^tmp_old_step_(\d+)$")


class CheckpointingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    checkpoint_dir: str = "results/checkpoints"
    save_period: int = Field(10, gt=0)
    # None keeps every checkpoint; the latest checkpoint is always kept in addition to the top k.
    keep_top_k: int | None = Field(3, ge=1)
    # Looked up in training_info[metric_name], then training_info["metrics"][metric_name].
    # None ranks checkpoints by recency only.
    metric_name: str | None = "val/accuracy"
    higher_is_better: bool = True

    @field_validator("checkpoint_dir", mode="before")
    @classmethod
    def _fspath(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    return int(step)


def _fsync_path(path: Path) -> None:
    # Directories need an fsync too, or a rename/create inside them may not survive a power cut.
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() and hasattr(os, "O_DIRECTORY") else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return  # e.g. platforms that cannot open directories; best effort
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def _write_json_durable(path: Path, data: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


class CheckpointManager:
    """Creates, finalizes, finds and prunes checkpoints under ``cfg.checkpoint_dir``.

    Meant to be used by the single driver process. On construction, leftovers of a crashed save
    are cleaned up (``remove_stale_tmp``) unless ``cleanup_stale=False``.
    """

    def __init__(self, cfg: CheckpointingConfig | Mapping[str, Any], cleanup_stale: bool = True):
        self.cfg = cfg if isinstance(cfg, CheckpointingConfig) else CheckpointingConfig.model_validate(cfg)
        self.checkpoint_dir = Path(self.cfg.checkpoint_dir)
        if cleanup_stale and self.checkpoint_dir.is_dir():
            self.remove_stale_tmp()

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

        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint_dir / f"tmp_step_{step}"
        if tmp.exists():  # left over from a crash during an earlier save of this step
            shutil.rmtree(tmp)
        tmp.mkdir()
        _write_json_durable(tmp / _PENDING_INFO, info)
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
        info = json.loads(pending.read_text(encoding="utf-8"))
        step = int(m.group(1))

        # Everything the caller wrote must be on disk before training_info.json marks it complete.
        _fsync_tree(tmp)
        _write_json_durable(tmp / TRAINING_INFO, info)
        pending.unlink()
        _fsync_path(tmp)

        final = self.checkpoint_dir / f"step_{step}"
        old = self.checkpoint_dir / f"tmp_old_step_{step}"
        if final.exists():
            # os.replace cannot overwrite a non-empty directory: move the old one aside first.
            # A crash between the two renames leaves tmp_old_step_<N>, which remove_stale_tmp restores.
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_path(self.checkpoint_dir)
        if old.exists():
            shutil.rmtree(old)

        self.prune()
        return final

    # ---------------------------------------------------------------- finding
    def _finalized(self) -> list[tuple[int, Path]]:
        if not self.checkpoint_dir.is_dir():
            return []
        out = []
        for child in self.checkpoint_dir.iterdir():
            m = _STEP_RE.match(child.name)
            if m and child.is_dir() and (child / TRAINING_INFO).is_file():
                out.append((int(m.group(1)), child))
        return sorted(out)

    def list_checkpoints(self) -> list[Path]:
        """Finalized checkpoints, oldest first."""
        return [path for _step, path in self._finalized()]

    def get_latest_checkpoint_path(self) -> Path | None:
        ckpts = self._finalized()
        return ckpts[-1][1] if ckpts else None

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
        """Best by ``metric_name`` (ties -> newer); the latest when no checkpoint has the metric."""
        ranked = self._ranked()
        return ranked[0][1] if ranked else None

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
    def prune(self) -> list[Path]:
        """Deletes checkpoints outside the top ``keep_top_k`` (the latest is always kept); returns them."""
        k = self.cfg.keep_top_k
        ckpts = self._finalized()
        if k is None or len(ckpts) <= k:
            return []
        latest_step = ckpts[-1][0]
        keep = {step for step, _ in self._ranked()[:k]} | {latest_step}
        removed = []
        for step, path in ckpts:
            if step not in keep:
                shutil.rmtree(path)
                removed.append(path)
        return removed

    def remove_stale_tmp(self) -> list[Path]:
        """Removes leftovers of interrupted saves; restores a step_<N> that a crash left moved aside."""
        if not self.checkpoint_dir.is_dir():
            return []
        removed = []
        for child in sorted(self.checkpoint_dir.iterdir()):
            m = _TMP_OLD_RE.match(child.name)
            if m:
                final = self.checkpoint_dir / f"step_{m.group(1)}"
                if not final.exists() and (child / TRAINING_INFO).is_file():
                    os.replace(child, final)
                    continue
            if m or _TMP_STEP_RE.match(child.name):
                shutil.rmtree(child)
                removed.append(child)
        return removed
