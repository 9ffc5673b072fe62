"""checkpointing.resume: auto continues, true must continue, false starts fresh and keeps the earlier run."""

from __future__ import annotations

import pytest

from nemo_like.utils.checkpoint import CheckpointError, CheckpointManager, preflight_checkpoints


def _save(mgr: CheckpointManager, step: int, payload: str) -> None:
    tmp = mgr.init_tmp_checkpoint(step, {"metrics": {"val/accuracy": 0.5}})
    (tmp / "weights.txt").write_text(payload)
    mgr.finalize_checkpoint(tmp)


def _earlier_run(d) -> None:
    mgr = CheckpointManager({"checkpoint_dir": str(d)}).lock()
    _save(mgr, 10, "first run")
    _save(mgr, 20, "first run")
    (d / "experiment_reward_fns.json").write_text("[]")
    mgr.release_lock()


def test_resume_false_moves_the_earlier_run_aside_and_starts_from_nothing(tmp_path, capsys):
    d = tmp_path / "ckpt"
    _earlier_run(d)
    cfg = {"checkpoint_dir": str(d), "resume": False}
    mgr, latest = preflight_checkpoints(CheckpointManager(cfg).cfg)
    assert latest is None  # nothing is read before the lock is taken
    assert mgr.open_for_run(resume=False) is None
    assert "moved to" in capsys.readouterr().out
    assert sorted(c.name for c in d.iterdir()) == [".lock", "previous_1"]
    assert (d / "previous_1" / "step_20" / "weights.txt").read_text() == "first run"  # kept, never deleted
    assert (d / "previous_1" / "experiment_reward_fns.json").exists()
    assert mgr.get_latest_checkpoint_path() is None
    _save(mgr, 10, "second run")  # the new run's step 10 does not meet the old one
    assert [p.name for p in mgr.list_checkpoints()] == ["step_10"]
    mgr.release_lock()
    # A third fresh start takes the next number and leaves the first aside folder alone.
    again = CheckpointManager(cfg).lock()
    again.open_for_run(resume=False)
    assert sorted(c.name for c in d.iterdir()) == [".lock", "previous_1", "previous_2"]
    assert (d / "previous_2" / "step_10" / "weights.txt").read_text() == "second run"
    again.release_lock()


def test_resume_auto_finds_the_newest_and_true_refuses_when_there_is_none(tmp_path):
    d = tmp_path / "ckpt"
    _, latest = preflight_checkpoints(CheckpointManager({"checkpoint_dir": str(d)}).cfg)
    assert latest is None  # auto: nothing to continue is a new run
    with pytest.raises(CheckpointError, match=r"checkpointing.resume=true, but checkpointing.checkpoint_dir=.* "
                                              r"holds no checkpoint to continue"):
        preflight_checkpoints(CheckpointManager({"checkpoint_dir": str(d), "resume": True}).cfg)
    _earlier_run(d)
    _, latest = preflight_checkpoints(CheckpointManager({"checkpoint_dir": str(d), "resume": True}).cfg)
    assert latest == d / "step_20"
    _, latest = preflight_checkpoints(CheckpointManager({"checkpoint_dir": str(d)}).cfg)
    assert latest == d / "step_20"
