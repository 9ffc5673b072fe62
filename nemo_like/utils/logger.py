"""Metric logging to stdout, ``<log_dir>/metrics.jsonl``, TensorBoard and (optionally) wandb.

metrics.jsonl is the machine-readable record of a run: one JSON object per ``log_metrics``
call, ``{"step": N, "train/loss": ...}``. It is opened in append mode so a resumed run keeps
writing to the same file, and every line is flushed immediately so a crash loses at most
the line being written. A resumed run first drops the rows logged after its checkpoint
(``keep_steps_up_to``), so the file holds each step once.

samples.jsonl holds what the policy wrote: one row per sample (step, split, task, prompt, completion,
reward, ...), every validation's and, when asked, the first few of each training step's. It is
trimmed and set aside with metrics.jsonl. The first few of each validation's also go to TensorBoard
(a markdown table, tag ``val/samples``) and wandb (a table, key ``val/samples``) when those are on.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from nemo_like.utils.jsonl_files import (
    METRICS_FILENAME,
    aside_name,
    json_safe,
    open_jsonl_for_append,
    replace_lines,
)
from nemo_like.utils.progress import progress_write
from nemo_like.utils.sample_table import VAL_SAMPLES_TAG, markdown_table, sample_table

SAMPLES_FILENAME = "samples.jsonl"
CONFIG_FILENAME = "config.yaml"
TENSORBOARD_SUBDIR = "tensorboard"


def _fspath_or_none(value: Any) -> Any:
    # YAML gives strings, Python callers often pass Path objects: accept both.
    return os.fspath(value) if isinstance(value, os.PathLike) else value


class WandbConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The wandb project the run is logged under.
    project: str = "nemo_like"
    # The run's display name; None: wandb picks one.
    name: str | None = None
    # "online": upload as the run goes; "offline": write locally only (wandb sync uploads it later);
    # "disabled": wandb does nothing.
    mode: Literal["online", "offline", "disabled"] = "offline"
    # Where wandb writes its run folder; None means the logger's log_dir.
    dir: str | None = None

    _fspath = field_validator("dir", mode="before")(_fspath_or_none)


class LoggerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Folder of metrics.jsonl, tensorboard/ and config.yaml (the run's config).
    log_dir: str = "logs"
    # Print the metrics to the console (see stdout_format).
    stdout_enabled: bool = True
    # "line": one line per step (step, reward, loss, validation accuracy when validated, seconds) and a
    # table of the validation metrics when there are some; "table": every metric of every step. The
    # full detail is always in metrics.jsonl.
    stdout_format: Literal["line", "table"] = "line"
    # Append one JSON row per logged step to <log_dir>/metrics.jsonl.
    jsonl_enabled: bool = True
    # Write TensorBoard events to <log_dir>/tensorboard.
    tensorboard_enabled: bool = True
    # Language-model runs: held-out samples printed after each validation (task, reward, the prompt's
    # end, the completion); 0: none.
    num_val_samples_to_print: int = Field(0, ge=0)
    # Every validation's samples (prompt, completion, reward, ground truth) to <log_dir>/samples.jsonl
    # (with jsonl_enabled).
    log_val_samples: bool = True
    # The first N samples of each validation as a table (step, task, prompt, completion, reward, ground
    # truth, ...) to TensorBoard's Text tab and to wandb, under val/samples, when those loggers are on;
    # 0: none.
    num_val_samples_to_table: int = Field(32, ge=0)
    # The first N samples of every training step to samples.jsonl too; 0: none.
    num_train_samples_to_log: int = Field(0, ge=0)
    # Log to Weights & Biases too (settings in wandb; needs the wandb extra).
    wandb_enabled: bool = False
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    _fspath = field_validator("log_dir", mode="before")(_fspath_or_none)


def _to_float(value: Any) -> float | None:
    """A Python float for scalar numeric values (bool, int, float, numpy scalar, 1-element tensor/array).

    Returns None for anything else, which the caller skips: strings, lists, multi-element tensors.
    """
    if isinstance(value, numbers.Number | np.generic) and not isinstance(value, complex | np.complexfloating):
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is already imported
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        return float(value.detach().cpu().item())
    if isinstance(value, np.ndarray) and value.size == 1 and np.issubdtype(value.dtype, np.number):
        if np.issubdtype(value.dtype, np.complexfloating):
            return None
        return float(value.reshape(()))
    return None


def _yaml_safe(value: Any) -> Any:
    """Converts a config (pydantic models, Paths, tuples, numpy scalars) into plain YAML/JSON types."""
    if isinstance(value, BaseModel):
        return _yaml_safe(value.model_dump(mode="json"))
    if isinstance(value, Mapping):
        return {str(k): _yaml_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_yaml_safe(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _format_value(value: float) -> str:
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def _default_print(text: str) -> None:
    # Above a live progress bar instead of through it; a plain line when there is none.
    progress_write(text)


class Logger:
    """Fans metrics out to the enabled backends. Use ``close()`` (idempotent) at the end of a run."""

    def __init__(self, cfg: LoggerConfig | Mapping[str, Any], print_fn: Callable[[str], None] | None = None):
        self.cfg = cfg if isinstance(cfg, LoggerConfig) else LoggerConfig.model_validate(cfg)
        self.log_dir = Path(self.cfg.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.print_fn = print_fn or _default_print
        self._closed = False
        self._jsonl = None
        self._samples = None  # samples.jsonl, opened at its first row
        # The TensorBoard writer starts with the first metric, once a resume has said which step the
        # crashed run's later events are hidden from (purge_step).
        self._tb_writer = None
        self._tb_purge_step: int | None = None
        self._wandb_run = None

        if self.cfg.jsonl_enabled:
            self._jsonl = open_jsonl_for_append(self.log_dir / METRICS_FILENAME)
        if self.cfg.wandb_enabled:
            self._wandb_run = self._init_wandb()

    @property
    def metrics_path(self) -> Path:
        return self.log_dir / METRICS_FILENAME

    @property
    def samples_path(self) -> Path:
        return self.log_dir / SAMPLES_FILENAME

    def wants_samples(self, split: str) -> int | None:
        """How many of a ``split`` ("val" or "train") batch's samples ``log_samples`` would use: 0 for
        none, None for all."""
        if split == "val":
            written = self.cfg.jsonl_enabled and self.cfg.log_val_samples
            printed = self.cfg.stdout_enabled and self.cfg.num_val_samples_to_print
            return None if written or printed or self._tables_wanted() else 0
        return self.cfg.num_train_samples_to_log if self.cfg.jsonl_enabled else 0

    def log_samples(self, rows: list[Mapping[str, Any]], step: int, split: str) -> None:
        """Rows of samples (``nemo_like.experience.samples.sample_rows``) of ``step`` to samples.jsonl;
        for "val" also the first ``num_val_samples_to_print`` to stdout and the first
        ``num_val_samples_to_table`` as a table to TensorBoard and wandb. A value JSON cannot hold
        (NaN, a tensor, a tuple key) is written as null or as text: a side log never stops a run."""
        if self._closed:
            raise RuntimeError("Logger.log_samples called after close()")
        if split == "val" and self.cfg.stdout_enabled and (n := self.cfg.num_val_samples_to_print):
            self.print_fn(self.format_samples(rows[:n], step, len(rows)))
        if split == "val" and rows and self._tables_wanted():
            self._log_sample_table(rows[: self.cfg.num_val_samples_to_table], int(step))
        keep = len(rows) if split == "val" and self.cfg.log_val_samples else (
            self.cfg.num_train_samples_to_log if split == "train" else 0)
        if not (self.cfg.jsonl_enabled and keep and rows):
            return
        if self._samples is None:
            self._samples = open_jsonl_for_append(self.samples_path)
        lines = [json.dumps(json_safe({"step": int(step), "split": split} | dict(row)), allow_nan=False) + "\n"
                 for row in rows[:keep]]
        self._samples.writelines(lines)
        self._samples.flush()

    def _tables_wanted(self) -> bool:
        on = self.cfg.tensorboard_enabled or self._wandb_run is not None
        return bool(on and self.cfg.num_val_samples_to_table)

    def _log_sample_table(self, rows: list[Mapping[str, Any]], step: int) -> None:
        columns, data = sample_table(rows, step)
        if self.cfg.tensorboard_enabled:
            writer = self._tensorboard()
            writer.add_text(VAL_SAMPLES_TAG, markdown_table(columns, data), global_step=step)
            writer.flush()
        if self._wandb_run is not None:
            import wandb  # present: the run was started with it

            self._wandb_run.log({VAL_SAMPLES_TAG: wandb.Table(columns=columns, data=data)}, step=step)

    @staticmethod
    def format_samples(rows: list[Mapping[str, Any]], step: int, total: int, width: int = 300) -> str:
        """A readable block: per sample its task, reward, the prompt's last ``width`` characters and
        the completion's first ``width``."""
        def cut(text: Any, tail: bool) -> str:
            text = str(text).replace("\n", "\\n")
            if len(text) <= width:
                return text
            return "..." + text[-width:] if tail else text[:width] + "..."

        lines = [f"[nemo_like] validation samples at step {step} ({len(rows)} of {total}):"]
        for r in rows:
            reward = r.get("reward")
            unscored = reward is None or (isinstance(reward, float) and math.isnan(reward))
            lines.append(f"  [{r.get('task')}] reward {'-' if unscored else f'{reward:.3g}'}"
                         f"  prompt: {cut(r.get('prompt', ''), True)}")
            lines.append(f"      completion: {cut(r.get('completion', ''), False)}")
        return "\n".join(lines)

    def keep_steps_up_to(self, step: int) -> list[dict[str, Any]]:
        """For a run resumed from a checkpoint at ``step``: drops the rows of metrics.jsonl logged
        after it (by the run that crashed later; this run logs those steps again) and returns the
        rows kept (their metrics; record fields are left out). The file is rewritten atomically (temp file + os.replace, then reopened for
        appending) and TensorBoard hides the crashed run's events after ``step``."""
        if self._closed:
            raise RuntimeError("Logger.keep_steps_up_to called after close()")
        path = self.metrics_path
        kept_lines, rows, bad, total = [], [], [], 0
        if path.exists():
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, start=1):
                    total = lineno
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        record = None
                    if not isinstance(record, dict):
                        bad.append(lineno)
                    elif record.get("step", 0) <= step:
                        kept_lines.append(line if line.endswith("\n") else line + "\n")
                        # The history gets the metrics; record fields (lists, strings) stay in the file.
                        rows.append({k: v for k, v in record.items() if not isinstance(v, list | dict | str)})
        if bad:
            warnings.warn(f"{path}: dropping malformed lines {bad[:10]}", stacklevel=2)
        if self._jsonl is not None and len(kept_lines) != total:
            self._jsonl.close()  # appending to the file being replaced would write into the old copy
            replace_lines(path, kept_lines)
            self._jsonl = open(path, "a", encoding="utf-8")
        if self._tb_writer is not None:  # already writing: start a new writer that purges
            self._tb_writer.close()
            self._tb_writer = None
        self._tb_purge_step = step + 1
        self._trim_samples(step)
        return rows

    def _trim_samples(self, step: int) -> None:
        """samples.jsonl without the rows of steps after ``step`` (a crashed run's; they come again)."""
        path = self.samples_path
        if not (self.cfg.jsonl_enabled and path.exists()):
            return
        if self._samples is not None:
            self._samples.close()
            self._samples = None
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
        kept = []
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by the crash
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        if len(kept) != len(lines):
            replace_lines(path, kept)

    def set_aside_previous_rows(self) -> Path | None:
        """For a run that starts at step 0: an earlier run's metrics.jsonl in the same log_dir (one
        that crashed before its first checkpoint, or ran without checkpoints) is renamed to
        ``metrics.prev<N>.jsonl``, so this run's file holds each of its steps once and the earlier
        rows are kept, not mixed in; its samples.jsonl goes to ``samples.prev<N>.jsonl``, the same N.
        TensorBoard hides the earlier run's events. Returns the metrics file's new name (None: none moved)."""
        if self._closed:
            raise RuntimeError("Logger.set_aside_previous_rows called after close()")
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None
        self._tb_purge_step = 0
        path, samples = self.metrics_path, self.samples_path
        move = [p for p, on in ((path, self._jsonl is not None), (samples, self.cfg.jsonl_enabled))
                if on and p.exists() and p.stat().st_size > 0]
        if not move:
            return None
        # One number for both files, so metrics.prevN and samples.prevN are the same earlier run.
        n = 1
        while any(aside_name(p, n).exists() for p in (path, samples)):
            n += 1
        if self._samples is not None:
            self._samples.close()
            self._samples = None
        if self._jsonl is not None:
            self._jsonl.close()
        for p in move:
            os.replace(p, aside_name(p, n))
        if self._jsonl is not None:
            self._jsonl = open(path, "a", encoding="utf-8")
        moved = ", ".join(f"{p.name} to {aside_name(p, n).name}" for p in move)
        self.print_fn(f"[nemo_like] {self.log_dir} held an earlier run's rows (no checkpoint to resume): moved {moved}")
        return aside_name(path, n) if path in move else None

    def _tensorboard(self):
        if self._tb_writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb_writer = SummaryWriter(log_dir=str(self.log_dir / TENSORBOARD_SUBDIR),
                                            purge_step=self._tb_purge_step)
        return self._tb_writer

    def _init_wandb(self):
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "logger.wandb_enabled=true but wandb is not installed; install the 'wandb' extra "
                "(uv sync --extra wandb) or set logger.wandb_enabled=false"
            ) from e
        wcfg = self.cfg.wandb
        wandb_dir = Path(wcfg.dir) if wcfg.dir is not None else self.log_dir
        wandb_dir.mkdir(parents=True, exist_ok=True)
        return wandb.init(project=wcfg.project, name=wcfg.name, mode=wcfg.mode, dir=str(wandb_dir))

    @staticmethod
    def _prefixed(metrics: Mapping[str, Any], prefix: str | None) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, value in metrics.items():
            number = _to_float(value)
            if number is None:
                continue  # non-numeric (strings, lists, ...): not a scalar metric
            name = f"{prefix}/{key}" if prefix else str(key)
            if name == "step":
                raise ValueError("metric name 'step' is reserved for the step column of metrics.jsonl")
            out[name] = number
        return out

    def log_metrics(self, metrics: Mapping[str, Any], step: int, prefix: str | None = None,
                    record: Mapping[str, Any] | None = None) -> dict[str, float]:
        """Logs scalar metrics at ``step``; returns the (prefixed, float) metrics that were logged.
        ``record``: fields of any JSON type written to metrics.jsonl's row only (not metrics: no
        TensorBoard, wandb or stdout), e.g. the prompts a step trained."""
        if self._closed:
            raise RuntimeError("Logger.log_metrics called after close()")
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics must be a mapping of name -> number, got {type(metrics).__name__}")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        step = int(step)
        values = self._prefixed(metrics, prefix)

        if self._jsonl is not None:
            row: dict[str, Any] = {"step": step}
            # JSON has no NaN/Infinity; null keeps every line parseable by any JSON reader.
            row.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
            for k, v in (record or {}).items():
                if k in row:
                    raise ValueError(f"record field {k!r} is also a metric name")
                row[k] = v
            self._jsonl.write(json.dumps(row, allow_nan=False) + "\n")
            self._jsonl.flush()
        if self.cfg.tensorboard_enabled:
            writer = self._tensorboard()
            for name, value in values.items():
                writer.add_scalar(name, value, global_step=step)
            writer.flush()
        if self._wandb_run is not None and values:
            self._wandb_run.log(values, step=step)
        if self.cfg.stdout_enabled and values:
            if self.cfg.stdout_format == "table":
                self.print_fn(self.format_block(values, step, prefix))
            else:
                self.print_fn(self.format_line(values, step))
                if val := {k: v for k, v in values.items() if k.startswith("val/")}:
                    self.print_fn(self.format_block(val, step, "validation"))
        return values

    # The step's line: these metrics when present, in this order (language models, then gym agents).
    LINE_KEYS = (("reward", "train/reward_mean"), ("return", "train/return_mean"), ("loss", "train/loss"),
                 ("val/accuracy", "val/accuracy"), ("val/return", "val/return_mean"),
                 ("critic EV", "critic/vf_explained_var"))

    @classmethod
    def format_line(cls, values: Mapping[str, float], step: int) -> str:
        parts = [f"step {step}"]
        parts += [f"{label} {_format_value(values[k])}" for label, k in cls.LINE_KEYS if k in values]
        if "timing/total" in values:
            parts.append(f"{values['timing/total']:.2f} s")
        elif "timing/validation" in values:  # a validation on its own (at the start or the end)
            parts.append(f"validation {values['timing/validation']:.2f} s")
        return "  ".join(parts)

    @staticmethod
    def format_block(values: Mapping[str, float], step: int, prefix: str | None = None) -> str:
        title = f" step {step}" + (f" [{prefix}]" if prefix else "") + " "
        width = max(len(k) for k in values)
        lines = [f"{title:=^{max(width + 14, 30)}}"]
        lines += [f"  {k:<{width}}  {_format_value(values[k])}" for k in sorted(values)]
        return "\n".join(lines)

    def log_hyperparams(self, params: Mapping[str, Any] | BaseModel) -> None:
        """Writes ``<log_dir>/config.yaml`` (overwritten: the latest run's config) and the wandb config."""
        if self._closed:
            raise RuntimeError("Logger.log_hyperparams called after close()")
        plain = _yaml_safe(params)
        if not isinstance(plain, dict):
            raise TypeError(f"hyperparams must be a mapping or pydantic model, got {type(params).__name__}")
        tmp = self.log_dir / (CONFIG_FILENAME + ".tmp")
        tmp.write_text(yaml.safe_dump(plain, sort_keys=False), encoding="utf-8")
        os.replace(tmp, self.log_dir / CONFIG_FILENAME)
        if self._wandb_run is not None:
            self._wandb_run.config.update(plain, allow_val_change=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._samples is not None:
            self._samples.close()
            self._samples = None
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
