"""Tests for nemo_like.utils: Logger (jsonl / TensorBoard / wandb offline / stdout), CheckpointManager, Timer."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from pydantic import ValidationError

from nemo_like.utils import (
    CheckpointingConfig,
    CheckpointManager,
    Logger,
    LoggerConfig,
    Timer,
    read_metrics_jsonl,
)


def _cfg(tmp_path: Path, **kw) -> LoggerConfig:
    base = dict(log_dir=str(tmp_path / "logs"), stdout_enabled=False, tensorboard_enabled=False)
    base.update(kw)
    return LoggerConfig(**base)


# ------------------------------------------------------------------ logger
def test_jsonl_prefix_conversion_nan_and_skips(tmp_path):
    with Logger(_cfg(tmp_path)) as logger:
        logged = logger.log_metrics(
            {
                "loss": torch.tensor(0.25),
                "reward_mean": np.float32(0.5),
                "num": np.int64(7),
                "kl": float("nan"),
                "inf": float("inf"),
                "note": "text",  # non-numeric: skipped
                "vec": torch.ones(3),  # not a scalar: skipped
            },
            step=1,
            prefix="train",
        )
        logger.log_metrics({"val/accuracy": 0.72}, step=2)
    assert set(logged) == {"train/loss", "train/reward_mean", "train/num", "train/kl", "train/inf"}
    raw = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    assert len(raw) == 2
    assert "NaN" not in raw[0] and "Infinity" not in raw[0]
    first, second = (json.loads(line) for line in raw)
    assert first == {
        "step": 1,
        "train/loss": 0.25,
        "train/reward_mean": 0.5,
        "train/num": 7.0,
        "train/kl": None,
        "train/inf": None,
    }
    assert second == {"step": 2, "val/accuracy": 0.72}
    assert read_metrics_jsonl(tmp_path / "logs") == [first, second]


def test_jsonl_flushed_per_line_and_appends_on_reopen(tmp_path):
    logger = Logger(_cfg(tmp_path))
    logger.log_metrics({"loss": 1.0}, step=0, prefix="train")
    # Visible before close: each line is flushed.
    assert read_metrics_jsonl(logger.metrics_path) == [{"step": 0, "train/loss": 1.0}]
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        logger.log_metrics({"loss": 1.0}, step=1)

    # Simulate a crash mid-write of a later line: the resumed logger drops the partial line.
    with open(tmp_path / "logs" / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "train/lo')
    with pytest.warns(UserWarning, match="truncated last line"):
        resumed = Logger(_cfg(tmp_path))
    resumed.log_metrics({"loss": 0.5}, step=1, prefix="train")
    resumed.close()
    records = read_metrics_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert records == [{"step": 0, "train/loss": 1.0}, {"step": 1, "train/loss": 0.5}]


def test_bad_inputs_have_clear_errors(tmp_path):
    with Logger(_cfg(tmp_path)) as logger:
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            logger.log_metrics({"a": 1.0}, step=-1)
        with pytest.raises(ValueError, match="reserved"):
            logger.log_metrics({"step": 1.0}, step=1)
        with pytest.raises(TypeError, match="mapping"):
            logger.log_metrics([1.0], step=1)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="tensorbord_enabled"):
        LoggerConfig(tensorbord_enabled=True)
    with pytest.raises(ValidationError, match="mode"):
        LoggerConfig(wandb={"mode": "sometimes"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_metrics_jsonl(bad)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_metrics_jsonl(tmp_path / "missing.jsonl")


def test_stdout_block_sorted_aligned_4_sig_digits(tmp_path):
    lines: list[str] = []
    with Logger(_cfg(tmp_path, stdout_enabled=True, stdout_format="table"), print_fn=lines.append) as logger:
        logger.log_metrics({"reward_mean": 0.123456, "loss": 12345.678, "n": 3}, step=5, prefix="train")
    assert len(lines) == 1
    block = lines[0].splitlines()
    assert "step 5" in block[0]
    assert [row.split()[0] for row in block[1:]] == ["train/loss", "train/n", "train/reward_mean"]
    assert [row.split()[1] for row in block[1:]] == ["1.235e+04", "3", "0.1235"]
    # Values start in the same column.
    assert len({row.index(row.split()[1]) for row in block[1:]}) == 1


def test_stdout_is_one_line_per_step_and_a_table_only_at_validation(tmp_path):
    lines: list[str] = []
    with Logger(_cfg(tmp_path, stdout_enabled=True), print_fn=lines.append) as logger:
        logger.log_metrics({"train/reward_mean": 0.61333, "train/loss": 0.0079, "timing/total": 1.266,
                            "train/grad_norm": 1.08, "perf/train_tokens_per_s": 3e4}, step=1)
        assert lines == ["step 1  reward 0.6133  loss 0.0079  1.27 s"]
        logger.log_metrics({"train/reward_mean": 0.7, "timing/total": 0.5, "val/accuracy": 0.875,
                            "val/num_samples": 32, "timing/validation": 1.1}, step=2)
    assert lines[1] == "step 2  reward 0.7  val/accuracy 0.875  0.50 s"
    table = lines[2].splitlines()
    assert "step 2 [validation]" in table[0] and [r.split()[0] for r in table[1:]] == ["val/accuracy", "val/num_samples"]
    assert len(lines) == 3
    # Everything is still in metrics.jsonl.
    rows = read_metrics_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert rows[0]["perf/train_tokens_per_s"] == 3e4 and rows[1]["val/num_samples"] == 32


def test_default_print_goes_to_stdout(tmp_path, capsys):
    with Logger(_cfg(tmp_path, stdout_enabled=True)) as logger:
        logger.log_metrics({"accuracy": 0.5}, step=0, prefix="val")
    assert "val/accuracy" in capsys.readouterr().out


def test_tensorboard_event_file_and_hyperparams(tmp_path):
    with Logger(_cfg(tmp_path, tensorboard_enabled=True)) as logger:
        logger.log_metrics({"loss": 0.5}, step=3, prefix="train")
        logger.log_hyperparams({"grpo": {"lr": 1e-3, "dir": Path("/x"), "sizes": (1, 2)}})
    events = list((tmp_path / "logs" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    scalars = acc.Scalars("train/loss")
    assert [(s.step, s.value) for s in scalars] == [(3, 0.5)]
    config = yaml.safe_load((tmp_path / "logs" / "config.yaml").read_text())
    assert config == {"grpo": {"lr": 1e-3, "dir": "/x", "sizes": [1, 2]}}


def test_wandb_offline_run_under_log_dir(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path, wandb_enabled=True, wandb={"project": "nemo_like_test", "name": "t", "mode": "offline"})
    logger = Logger(cfg)
    logger.log_hyperparams({"lr": 0.1})
    logger.log_metrics({"loss": 0.5}, step=1, prefix="train")
    logger.log_metrics({"loss": 0.25}, step=2, prefix="train")
    logger.close()
    assert wandb.run is None  # finished by close()
    runs = list((tmp_path / "logs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    run_files = list(runs[0].glob("*.wandb"))
    assert len(run_files) == 1 and run_files[0].stat().st_size > 0


# -------------------------------------------------------------- checkpoint
def _save(mgr: CheckpointManager, step: int, acc: float | None = None) -> Path:
    info = {"metrics": {"val/accuracy": acc} if acc is not None else {}}
    tmp = mgr.init_tmp_checkpoint(step, info)
    (tmp / "policy").mkdir()
    (tmp / "policy" / "weights.bin").write_bytes(b"w" * 16)
    torch.save({"step": step}, tmp / "train_state.pt")
    return mgr.finalize_checkpoint(tmp)


def _steps(mgr: CheckpointManager) -> list[int]:
    return [int(p.name.split("_")[1]) for p in mgr.list_checkpoints()]


def test_checkpoint_layout_and_training_info(tmp_path):
    mgr = CheckpointManager(CheckpointingConfig(checkpoint_dir=tmp_path / "ckpt", keep_top_k=None))
    assert mgr.get_latest_checkpoint_path() is None and mgr.get_best_checkpoint_path() is None
    final = _save(mgr, 10, acc=0.5)
    assert final == tmp_path / "ckpt" / "step_10"
    assert sorted(p.name for p in final.iterdir()) == ["manifest.json", "policy", "train_state.pt",
                                                       "training_info.json"]
    assert mgr.load_training_info(final) == {"metrics": {"val/accuracy": 0.5}, "step": 10}
    # The manifest, written last, lists every other file with its size and sha256.
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["step"] == 10
    assert sorted(manifest["files"]) == ["policy/weights.bin", "train_state.pt", "training_info.json"]
    assert manifest["files"]["policy/weights.bin"]["size"] == 16
    assert len(manifest["files"]["policy/weights.bin"]["sha256"]) == 64
    assert torch.load(final / "train_state.pt") == {"step": 10}
    assert not list((tmp_path / "ckpt").glob("tmp_*"))
    # Re-saving the same step replaces it safely.
    tmp = mgr.init_tmp_checkpoint(10, {"metrics": {"val/accuracy": 0.9}})
    mgr.finalize_checkpoint(tmp)
    assert mgr.load_training_info(final)["metrics"]["val/accuracy"] == 0.9
    assert not (final / "policy").exists()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_10"]


def test_crash_leftover_tmp_never_latest(tmp_path):
    cfg = CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"))
    mgr = CheckpointManager(cfg)
    _save(mgr, 10, acc=0.5)
    # "Crash" during the save of step 20: caller wrote files, finalize never ran.
    tmp = mgr.init_tmp_checkpoint(20, {"metrics": {"val/accuracy": 0.9}})
    (tmp / "train_state.pt").write_bytes(b"partial")
    assert mgr.get_latest_checkpoint_path() == tmp_path / "ckpt" / "step_10"
    assert mgr.get_best_checkpoint_path() == tmp_path / "ckpt" / "step_10"
    # Even a tmp dir that already holds training_info.json (crash right before the rename) is ignored.
    (tmp / "training_info.json").write_text(json.dumps({"step": 20}))
    assert mgr.get_latest_checkpoint_path() == tmp_path / "ckpt" / "step_10"
    # A step_* dir without a manifest is not a checkpoint either: skipped, saying why.
    (tmp_path / "ckpt" / "step_30").mkdir()
    with pytest.warns(UserWarning, match=r"skipping checkpoint step_30 \(no manifest.json"):
        assert mgr.get_latest_checkpoint_path() == tmp_path / "ckpt" / "step_10"
    (tmp_path / "ckpt" / "step_30").rmdir()

    # The resumed run cleans up on construction; re-initialising the same step starts clean.
    resumed = CheckpointManager(cfg)
    assert not (tmp_path / "ckpt" / "tmp_step_20").exists()
    tmp2 = resumed.init_tmp_checkpoint(20, {})
    assert [p.name for p in tmp2.iterdir()] == [".pending_training_info.json"]
    resumed.finalize_checkpoint(tmp2)
    assert resumed.get_latest_checkpoint_path() == tmp_path / "ckpt" / "step_20"


def test_crash_between_renames_restores_old_step(tmp_path):
    cfg = CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"))
    mgr = CheckpointManager(cfg)
    _save(mgr, 10, acc=0.5)
    os.replace(tmp_path / "ckpt" / "step_10", tmp_path / "ckpt" / "tmp_old_step_10")
    # Until a run puts it back, the moved-aside copy stands in for step_10 (a resume reads its config).
    assert mgr.get_latest_checkpoint_path() == tmp_path / "ckpt" / "tmp_old_step_10"
    assert mgr.remove_stale_tmp() == []
    assert mgr.get_latest_checkpoint_path() == tmp_path / "ckpt" / "step_10"


def test_top_k_pruning_metrics_ties_and_latest_kept(tmp_path):
    mgr = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"), keep_top_k=2))
    _save(mgr, 1, acc=0.9)
    _save(mgr, 2, acc=0.5)
    _save(mgr, 3, acc=0.7)
    assert _steps(mgr) == [1, 3]  # 0.5 pruned; latest (3) is also in the top 2
    _save(mgr, 4, acc=0.1)
    assert _steps(mgr) == [1, 3, 4]  # top 2 = {1, 3}, plus the latest even though it is worst
    _save(mgr, 5, acc=0.7)
    assert _steps(mgr) == [1, 5]  # tie 0.7 between 3 and 5: newer wins; 4 no longer latest
    _save(mgr, 6)  # missing metric ranks lowest, but the latest is kept
    assert _steps(mgr) == [1, 5, 6]
    _save(mgr, 7, acc=0.95)
    assert _steps(mgr) == [1, 7]
    assert mgr.get_best_checkpoint_path() == tmp_path / "ckpt" / "step_7"
    assert mgr.get_latest_checkpoint_path() == tmp_path / "ckpt" / "step_7"


def test_lower_is_better_flat_metric_and_no_metric(tmp_path):
    cfg = CheckpointingConfig(
        checkpoint_dir=str(tmp_path / "a"), keep_top_k=1, metric_name="val/loss", higher_is_better=False
    )
    mgr = CheckpointManager(cfg)
    for step, loss in [(1, 0.3), (2, 0.1), (3, 0.2)]:
        mgr.finalize_checkpoint(mgr.init_tmp_checkpoint(step, {"val/loss": loss}))
    assert _steps(mgr) == [2, 3]
    assert mgr.get_best_checkpoint_path().name == "step_2"

    recency = CheckpointManager(
        CheckpointingConfig(checkpoint_dir=str(tmp_path / "b"), keep_top_k=2, metric_name=None)
    )
    for step in (1, 2, 3):
        recency.finalize_checkpoint(recency.init_tmp_checkpoint(step, {"val/accuracy": 1.0 / step}))
    assert _steps(recency) == [2, 3]
    assert recency.get_best_checkpoint_path().name == "step_3"


def test_checkpoint_bad_inputs(tmp_path):
    with pytest.raises(ValidationError, match="save_period"):
        CheckpointingConfig(save_period=0)
    with pytest.raises(ValidationError, match="keep_top_k"):
        CheckpointingConfig(keep_top_k=0)
    with pytest.raises(ValidationError, match="keep_best"):
        CheckpointingConfig(keep_best=2)
    mgr = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"), save_period=5))
    assert [s for s in range(12) if mgr.should_save(s)] == [0, 5, 10]
    assert mgr.should_save(7, is_last_step=True)
    with pytest.raises(ValueError, match="non-negative int"):
        mgr.init_tmp_checkpoint(-1, {})
    with pytest.raises(ValueError, match="JSON-serialisable"):
        mgr.init_tmp_checkpoint(1, {"obj": object()})
    with pytest.raises(ValueError, match="JSON-serialisable"):
        mgr.init_tmp_checkpoint(1, {"loss": math.nan})
    with pytest.raises(ValueError, match="disagrees"):
        mgr.init_tmp_checkpoint(1, {"step": 2})
    with pytest.raises(ValueError, match="not a temporary checkpoint"):
        mgr.finalize_checkpoint(tmp_path / "elsewhere" / "tmp_step_1")
    with pytest.raises(FileNotFoundError, match="not a finalized checkpoint"):
        mgr.load_training_info(tmp_path / "ckpt")


# ------------------------------------------------------------------- timer
def test_timer_sum_mean_nested_and_errors():
    timer = Timer()
    with timer.time("generation"):
        time.sleep(0.05)
        with timer.time("logprobs"):
            time.sleep(0.02)
    timer.start("generation")
    time.sleep(0.03)
    assert 0.03 <= timer.stop("generation") < 0.5
    total = timer.get_timing_metrics("sum")
    mean = timer.get_timing_metrics(reduction="mean")
    assert set(total) == {"generation", "logprobs"}
    assert 0.10 <= total["generation"] < 0.6
    assert 0.02 <= total["logprobs"] < 0.3
    assert mean["generation"] == pytest.approx(total["generation"] / 2)
    assert total["generation"] > total["logprobs"]

    with pytest.raises(RuntimeError, match="not running"):
        timer.stop("train")
    timer.start("train")
    with pytest.raises(RuntimeError, match="already running"):
        timer.start("train")
    assert "train" not in timer.get_timing_metrics()  # still running: not reported
    with pytest.raises(ValueError, match="reduction"):
        timer.get_timing_metrics("max")

    with pytest.raises(ZeroDivisionError), timer.time("reward"):
        raise ZeroDivisionError("body failed")
    assert "reward" in timer.get_timing_metrics()  # recorded even when the body raised
    timer.reset()
    assert timer.get_timing_metrics() == {}
    timer.start("train")  # reset also cleared the running timer


# ------------------------------------------------------------------ resume
def test_resume_drops_rows_after_the_checkpoint_from_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _cfg(tmp_path, tensorboard_enabled=True)
    with Logger(cfg) as crashed:
        crashed.log_metrics({"accuracy": 0.5}, step=0, prefix="val")
        for step in range(1, 6):  # checkpoint at step 3; steps 4 and 5 logged, then the crash
            crashed.log_metrics({"loss": float(step)}, step=step, prefix="train")
        crashed.log_metrics({"accuracy": 0.75}, step=5, prefix="val")
    path = tmp_path / "logs" / "metrics.jsonl"
    inode = path.stat().st_ino

    resumed = Logger(cfg)
    kept = resumed.keep_steps_up_to(3)
    assert kept == [{"step": 0, "val/accuracy": 0.5}] + [{"step": s, "train/loss": float(s)} for s in (1, 2, 3)]
    assert read_metrics_jsonl(path) == kept
    assert path.stat().st_ino != inode and not path.with_name("metrics.jsonl.tmp").exists()  # replaced whole
    # The resumed run's rows land in the new file, once per step.
    resumed.log_metrics({"loss": 40.0}, step=4, prefix="train")
    resumed.close()
    assert [(r["step"], r.get("train/loss")) for r in read_metrics_jsonl(path)] == [
        (0, None), (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    # TensorBoard reads both runs' event files; the crashed run's steps after 3 are purged from view.
    acc = EventAccumulator(str(tmp_path / "logs" / "tensorboard"))
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert [s.step for s in acc.Scalars("val/accuracy")] == [0]

    # With nothing after the checkpoint the file is left as it is.
    again = Logger(cfg)
    inode = path.stat().st_ino
    assert len(again.keep_steps_up_to(4)) == 5 and path.stat().st_ino == inode
    again.close()
    with pytest.raises(RuntimeError, match="after close"):
        again.keep_steps_up_to(4)


def test_a_run_from_step_0_sets_an_earlier_runs_rows_aside(tmp_path):
    """A run that crashed before its first checkpoint (or ran without checkpoints) and is started
    again in the same log_dir: its rows move to metrics.prev1.jsonl, the new file holds each step once."""
    cfg = _cfg(tmp_path)
    with Logger(cfg) as crashed:
        for step in (0, 1, 2):
            crashed.log_metrics({"loss": float(step)}, step=step, prefix="train")
    path = tmp_path / "logs" / "metrics.jsonl"
    fresh = Logger(cfg)
    aside = fresh.set_aside_previous_rows()
    assert aside == path.with_name("metrics.prev1.jsonl")
    assert [r["step"] for r in read_metrics_jsonl(aside)] == [0, 1, 2]  # kept, not lost
    fresh.log_metrics({"loss": 9.0}, step=0, prefix="train")
    fresh.close()
    assert read_metrics_jsonl(path) == [{"step": 0, "train/loss": 9.0}]
    again = Logger(cfg)
    assert again.set_aside_previous_rows() == path.with_name("metrics.prev2.jsonl")  # never overwrites
    assert again.set_aside_previous_rows() is None  # nothing left to set aside
    again.close()


def test_record_fields_go_to_the_jsonl_row_only_and_leave_the_history(tmp_path):
    lines: list[str] = []
    with Logger(_cfg(tmp_path), print_fn=lines.append) as logger:
        logger.log_metrics({"loss": 1.0}, step=1, prefix="train", record={"prompt_ids": ["math:3", "math:7"]})
        logger.log_metrics({"loss": 0.5}, step=2, prefix="train", record={"prompt_ids": ["math:1"]})
        with pytest.raises(ValueError, match="'train/loss' is also a metric name"):
            logger.log_metrics({"loss": 0.5}, step=3, prefix="train", record={"train/loss": 1})
        assert read_metrics_jsonl(logger.metrics_path) == [
            {"step": 1, "train/loss": 1.0, "prompt_ids": ["math:3", "math:7"]},
            {"step": 2, "train/loss": 0.5, "prompt_ids": ["math:1"]}]
        assert not any("math:" in line for line in lines)  # not printed
        # A resume at step 1 keeps its row in the file, and gives the trainer's history its metrics.
        assert logger.keep_steps_up_to(1) == [{"step": 1, "train/loss": 1.0}]
    assert read_metrics_jsonl(tmp_path / "logs" / "metrics.jsonl") == [
        {"step": 1, "train/loss": 1.0, "prompt_ids": ["math:3", "math:7"]}]


def _rows(n: int, tag: str) -> list[dict]:
    return [{"task": "math", "prompt": f"line one\n{i}+1=", "completion": f"{i + 1}{tag}",
             "reward": float(i % 2) if i else math.nan, "ground_truth": i + 1} for i in range(n)]


def test_samples_go_to_samples_jsonl_print_and_follow_a_resume(tmp_path):
    lines: list[str] = []
    cfg = _cfg(tmp_path, stdout_enabled=True, num_val_samples_to_print=2, num_train_samples_to_log=1)
    logger = Logger(cfg, print_fn=lines.append)
    assert (logger.wants_samples("val"), logger.wants_samples("train")) == (None, 1)
    logger.log_samples(_rows(3, "v"), step=0, split="val")
    for step in (1, 2, 3):  # the checkpoint is at step 2; step 3 is logged, then the crash
        logger.log_samples(_rows(3, "t")[: logger.wants_samples("train")], step=step, split="train")
    logger.log_samples(_rows(3, "v"), step=3, split="val")
    logger.close()
    read = lambda: [json.loads(x) for x in (tmp_path / "logs" / "samples.jsonl").read_text().splitlines()]  # noqa: E731
    rows = read()
    assert [(r["step"], r["split"]) for r in rows] == [(0, "val")] * 3 + [(1, "train"), (2, "train"), (3, "train")] + [
        (3, "val")] * 3
    assert rows[0] == {"step": 0, "split": "val", "task": "math", "prompt": "line one\n0+1=", "completion": "1v",
                       "reward": None, "ground_truth": 1}  # NaN reward (unscorable) as null
    # Two of the three validation samples printed (a block per validation), newlines shown as \n.
    printed = [x for x in lines if "validation samples" in x]
    assert len(printed) == 2 and printed[0].startswith("[nemo_like] validation samples at step 0 (2 of 3):")
    assert printed[0].count("completion:") == 2
    assert "reward -  prompt: line one\\n0+1=" in printed[0] and "completion: 2v" in printed[0]

    resumed = Logger(cfg, print_fn=lines.append)
    resumed.keep_steps_up_to(2)
    assert [(r["step"], r["split"]) for r in read()] == [(0, "val")] * 3 + [(1, "train"), (2, "train")]
    resumed.log_samples(_rows(1, "again"), step=3, split="train")
    resumed.close()
    assert read()[-1]["completion"] == "1again"
    # A run from step 0 in the same log_dir: both files aside under one number (metrics.prev1 was
    # taken by an older run without samples, so both become prev2).
    logs = tmp_path / "logs"
    (logs / "metrics.jsonl").rename(logs / "metrics.prev1.jsonl")
    (logs / "metrics.jsonl").write_text('{"step": 0}\n')
    fresh = Logger(cfg, print_fn=lines.append)
    assert fresh.set_aside_previous_rows() == logs / "metrics.prev2.jsonl"
    fresh.close()
    assert not (logs / "samples.jsonl").exists() and not (logs / "samples.prev1.jsonl").exists()
    assert len((logs / "samples.prev2.jsonl").read_text().splitlines()) == 6
    assert lines[-1].endswith("moved metrics.jsonl to metrics.prev2.jsonl, samples.jsonl to samples.prev2.jsonl")
    quiet = Logger(_cfg(tmp_path, log_val_samples=False, jsonl_enabled=False))
    assert (quiet.wants_samples("val"), quiet.wants_samples("train")) == (0, 0)  # stdout off, nothing printed
    quiet.close()
    # Printing only (no file): the block still counts the whole validation.
    printing = Logger(_cfg(tmp_path, stdout_enabled=True, jsonl_enabled=False, num_val_samples_to_print=1),
                      print_fn=lines.append)
    assert printing.wants_samples("val") is None
    printing.log_samples(_rows(3, "p"), step=5, split="val")
    assert lines[-1].startswith("[nemo_like] validation samples at step 5 (1 of 3):")
    printing.close()


def test_a_sample_value_json_cannot_hold_is_written_plainly_not_raised(tmp_path):
    with Logger(_cfg(tmp_path)) as logger:
        row = {"task": "t", "ground_truth": [1.0, math.nan], "meta": {("a", 1): math.inf, "t": torch.tensor([1, 2]),
                                                                      "s": np.float32("nan"), "obj": object}}
        logger.log_samples([row], step=1, split="val")
    got = json.loads((tmp_path / "logs" / "samples.jsonl").read_text())
    assert got["ground_truth"] == [1.0, None]
    assert got["meta"] == {"('a', 1)": None, "t": [1, 2], "s": None, "obj": str(object)}
