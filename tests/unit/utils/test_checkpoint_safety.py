"""Checkpoints are exact or refused: manifests and their verification, train states that load with
torch.load(weights_only=True), the checkpoint_dir lock, and real processes killed (SIGKILL) at every
point of a save, after which the directory resumes from its newest intact checkpoint with the exact
state that was saved (checkpoint_child.py is the process that gets killed)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from nemo_like.utils.checkpoint import (
    CheckpointError,
    CheckpointManager,
    DirLockedError,
    load_train_state,
    restore_rng,
    save_train_state,
)
from nemo_like.utils.checkpoint_io import capture_rng

REPO = Path(__file__).resolve().parents[3]
CHILD = Path(__file__).with_name("checkpoint_child.py")
_spec = importlib.util.spec_from_file_location("checkpoint_child", CHILD)
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)


def _spawn(*args) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, str(CHILD), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def _mgr(d: Path, **kw) -> CheckpointManager:
    return CheckpointManager({"checkpoint_dir": str(d), "keep_top_k": 2, "metric_name": None, **kw},
                             cleanup_stale=False)


def _save(mgr: CheckpointManager, step: int) -> Path:
    tmp = mgr.init_tmp_checkpoint(step, {"metrics": {"val/accuracy": step / 10}})
    (tmp / "policy").mkdir()
    (tmp / "policy" / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    save_train_state(tmp, {"step": step, "sampler": {"epoch": 0, "position": step}})
    return mgr.finalize_checkpoint(tmp)


def _light_state(path: Path) -> dict:
    """The state a LightRun child resumes from ``path``, loaded here (the RNGs of this process kept)."""
    mine = capture_rng()
    try:
        run = child.LightRun.__new__(child.LightRun)
        run.load_checkpoint(path)
        return run.digest()
    finally:
        restore_rng(mine)


# ---- manifests ----------------------------------------------------------------------------------
def test_manifest_names_each_damage_and_resume_skips_to_the_newest_intact(tmp_path):
    mgr = _mgr(tmp_path / "ckpt", keep_top_k=None)
    paths = {s: _save(mgr, s) for s in (1, 2, 3, 4, 5)}
    assert mgr.problems(paths[5]) == []
    (paths[5] / "policy" / "model.safetensors").unlink()                        # deleted
    with open(paths[4] / "train_state.pt", "r+b") as f:                          # truncated
        f.truncate(100)
    blob = bytearray((paths[3] / "policy" / "model.safetensors").read_bytes())  # same size, other bytes
    blob[7] ^= 0xFF
    (paths[3] / "policy" / "model.safetensors").write_bytes(bytes(blob))
    (paths[2] / "policy" / "model-00002.safetensors").write_bytes(b"stray shard")  # a file nobody saved
    assert mgr.problems(paths[5]) == ["policy/model.safetensors is missing"]
    assert mgr.problems(paths[4])[0].startswith("train_state.pt has 100 bytes, the manifest says ")
    assert mgr.problems(paths[3]) == ["policy/model.safetensors differs from the file that was saved (sha256)"]
    assert mgr.problems(paths[2]) == ["policy/model-00002.safetensors is not in the manifest"]

    with pytest.warns(UserWarning) as caught:
        assert mgr.get_latest_checkpoint_path() == paths[1]
    skipped = [str(w.message) for w in caught]
    assert len(skipped) == 4 and "skipping checkpoint step_5 (policy/model.safetensors is missing)" in skipped[0]
    assert all("using step_1, the newest intact one" in m for m in skipped)
    with pytest.raises(CheckpointError, match=r"checkpoint .*step_4 is damaged or incomplete: train_state.pt has"):
        load_train_state(paths[4])
    # Best by metric skips damaged ones too (step 5 has the best val/accuracy).
    with pytest.warns(UserWarning) as caught:
        assert mgr.get_best_checkpoint_path() == paths[1]
    assert len(caught) == 4 and all("using step_1, the best intact one" in str(w.message) for w in caught)

    # A run resuming from step_1 sets the damaged newer ones aside: it saves those steps again.
    (paths[1] / "manifest.json").unlink()
    with pytest.raises(CheckpointError) as e:
        mgr.get_latest_checkpoint_path()
    msg = str(e.value)
    assert msg.startswith(f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'} holds no intact checkpoint")
    for step in (5, 4, 3, 2):
        assert f"step_{step}: " in msg
    assert "step_1: no manifest.json (an unfinished save" in msg
    resaved = _save(mgr, 1)
    mgr.lock()
    with pytest.warns(UserWarning) as caught:
        assert mgr.resume_path() == resaved
    assert [str(w.message).split(": ")[-1] for w in caught if "moved" in str(w.message)] == [
        f"{tmp_path / 'ckpt'}/step_{s} is damaged; moved to invalid_step_{s}" for s in (2, 3, 4, 5)]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith(".")) == [
        "invalid_step_2", "invalid_step_3", "invalid_step_4", "invalid_step_5", "step_1"]
    mgr.release_lock()


# ---- train state --------------------------------------------------------------------------------
def test_train_state_is_tensors_and_plain_types_and_restores_the_exact_rngs(tmp_path):
    mine = capture_rng()
    try:
        random.seed(3), np.random.seed(4), torch.manual_seed(5)
        random.gauss(0, 1)  # a cached gaussian is part of the state too
        save_train_state(tmp_path, {"step": 7, "sampler": {"calls": 2, "parts": [{"epoch": 1, "position": 3}]},
                                    "last_val_results": {"task_name": ["math"], "correct": [True]}})
        expected = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), torch.rand(3).tolist())
        random.seed(0), np.random.seed(0), torch.manual_seed(0)
        state = torch.load(tmp_path / "train_state.pt", weights_only=True)  # no code runs to read it
        restore_rng(state["rng"])
        assert (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), torch.rand(3).tolist()) == expected
        assert state["sampler"] == {"calls": 2, "parts": [{"epoch": 1, "position": 3}]}
        assert load_train_state(tmp_path, verify=False)["step"] == 7
    finally:
        restore_rng(mine)

    # What weights_only=True could not read back is refused when saving, not when resuming.
    with pytest.raises(TypeError, match=r"train state \['sampler'\]\['order'\] is a ndarray"):
        save_train_state(tmp_path, {"sampler": {"order": np.arange(3)}})
    # A train state pickled by an older nemo_like (numpy RNG tuple, Python objects) is refused by name:
    # weights_only=True cannot read it, or, where a library imported in this process allowlisted numpy's
    # types for torch.load (megatron-core does), its missing format version names it.
    torch.save({"step": 1, "numpy_rng": np.random.get_state()}, tmp_path / "train_state.pt")
    with pytest.raises(CheckpointError, match="does not load as tensors and plain types|train state format None"):
        load_train_state(tmp_path, verify=False)


def test_no_torch_load_in_nemo_like_can_execute_code():
    offenders = []
    for path in sorted((REPO / "nemo_like").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            if not (isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []
    assert "import pickle" not in "".join(p.read_text() for p in (REPO / "nemo_like").rglob("*.py")
                                          if p.name != "checkpoint_io.py")


# ---- the lock -----------------------------------------------------------------------------------
def test_lock_refuses_a_second_user_and_is_taken_over_from_a_dead_one(tmp_path):
    d = tmp_path / "ckpt"
    first = _mgr(d).lock()
    tmp = first.init_tmp_checkpoint(1, {})  # a save in progress
    second = CheckpointManager({"checkpoint_dir": str(d)})  # cleanup_stale: not under a live run's save
    assert tmp.is_dir()
    with pytest.raises(DirLockedError, match=rf"is in use by another run \(this process \(pid {os.getpid()} on "
                                             rf"host {socket.gethostname()}, started 20"):
        second.lock()
    with pytest.raises(DirLockedError):
        second.init_tmp_checkpoint(2, {})  # saving without the lock is refused while someone holds it
    first.finalize_checkpoint(tmp)
    first.release_lock()
    second.lock()
    second.release_lock()

    # Another process holds it: named with its pid, host, start time and command; killed, it is taken over.
    code = ("import sys, time; from nemo_like.utils.dir_lock import DirLock; l = DirLock(sys.argv[1]); "
            "l.acquire(); print('locked', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(d)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(DirLockedError, match=rf"\(pid {holder.pid} on host {socket.gethostname()}, started "
                                                 r"\d{4}-\d\d-\d\dT[\d:]+[+-][\d:]+: -c\)"):
            _mgr(d).lock()
    finally:
        holder.kill()
        holder.wait()
    with pytest.warns(UserWarning, match=rf"taking over the lock of pid {holder.pid} \(started .*\), which ended "
                                         "without releasing it"):
        taker = _mgr(d).lock()
    assert json.loads((d / ".lock").read_text())["pid"] == os.getpid()
    taker.release_lock()
    assert (d / ".lock").read_text() == ""  # released: free, and nobody is named

    # A lock named by another host cannot be judged from here: refused, with what to do.
    (d / ".lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "yesterday"}))
    with pytest.raises(DirLockedError, match=r"locked by pid 1 on host elsewhere .* if that run has ended, delete"):
        _mgr(d).lock()


def test_setup_and_cli_refuse_a_checkpoint_dir_in_use_in_one_line(tmp_path):
    from nemo_like.algorithms.grpo_run import setup
    from nemo_like.config import ConfigError, load_config

    d = tmp_path / "ckpt"
    holder = _mgr(d).lock()
    overrides = [f"checkpointing.checkpoint_dir={d}", f"logger.log_dir={tmp_path / 'logs'}",
                 "data.train.generator.num_samples=50", "data.validation.generator.num_samples=10"]
    try:
        with pytest.raises(ConfigError, match=re.escape(f"checkpointing.checkpoint_dir={d} is in use by another "
                                                        f"run (this process (pid {os.getpid()}")):
            setup(load_config(REPO / "examples" / "configs" / "grpo_math_tiny.yaml", overrides))
        code = ("import sys; from nemo_like.cli import run_cli; from nemo_like.algorithms.grpo_run import setup; "
                "sys.exit(run_cli(sys.argv[1:], 'examples/configs/grpo_math_tiny.yaml', setup))")
        out = subprocess.run([sys.executable, "-c", code, *overrides], capture_output=True, text=True, cwd=REPO,
                             timeout=300)
    finally:
        holder.release_lock()
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"error: checkpointing.checkpoint_dir={d} is in use by another run (pid {os.getpid()} "
                           f"on host {socket.gethostname()}, started ")


# ---- kill -9 during saves -----------------------------------------------------------------------
# point -> the newest intact checkpoint after a kill there during the save of step 3 (2 saved before).
POINTS = {"init": 2, "train_state": 2, "manifest": 2, "rename": 2, "replace": 3, "prune": 3, "delete": 3}


def test_kill_at_each_point_of_a_save_resumes_the_newest_intact_checkpoint_exactly(tmp_path):
    procs = {p: _spawn(tmp_path / p / "ckpt", tmp_path / p / "rec", "-", 3, "--light", "--kill-at", p,
                       "--kill-step", 3, *(["--resave-step", 3] if p == "replace" else [])) for p in POINTS}
    for point, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL, (point, out, err)
        assert out.splitlines()[-1] == "SAVED 2", (point, out)  # killed in the save of step 3
    for point, newest in POINTS.items():
        d = tmp_path / point / "ckpt"
        leftovers = sorted(c.name for c in d.iterdir() if c.name.startswith("tmp_"))
        assert leftovers or point == "prune", point  # the save really was cut short
        mgr = _mgr(d)
        with pytest.warns(UserWarning, match=rf"taking over the lock of pid {procs[point].pid} "):
            latest = mgr.open_for_run()
        assert latest == d / f"step_{newest}", (point, leftovers)
        assert not [c for c in d.iterdir() if c.name.startswith("tmp_")]  # the crashed save's leftovers are gone
        expected = json.loads((tmp_path / point / "rec" / f"step_{newest}.json").read_text())
        assert _light_state(latest) == expected, point
        mgr.release_lock()


def test_kills_at_random_moments_of_a_saving_loop_always_resume_exactly(tmp_path):
    d, rec, rng = tmp_path / "ckpt", tmp_path / "rec", random.Random(0)
    last_saved = 0
    for _ in range(4):
        proc = _spawn(d, rec, "-", 100000, "--light")
        report = json.loads(proc.stdout.readline().removeprefix("RESUMED "))
        if last_saved:
            assert report["exact"] and report["resumed"] >= last_saved, report
        for _ in range(2 + rng.randrange(3)):
            last_saved = int(proc.stdout.readline().split()[1])
        time.sleep(rng.uniform(0, 0.03))  # then anywhere in training, recording or a save
        proc.kill()
        proc.communicate()
    mgr = _mgr(d)  # and the last round's kill
    with pytest.warns(UserWarning, match="taking over the lock"):
        latest = mgr.open_for_run()
    assert int(latest.name.split("_")[1]) >= last_saved
    assert _light_state(latest) == json.loads((rec / f"{latest.name}.json").read_text())
    mgr.release_lock()


def test_real_trainer_killed_mid_run_resumes_exact_weights_optimizer_rng_and_data(tmp_path, model_dir):
    d, rec = tmp_path / "ckpt", tmp_path / "rec"
    proc = _spawn(d, rec, model_dir, 100000)
    assert json.loads(proc.stdout.readline().removeprefix("RESUMED ")) == {"resumed": None}
    assert proc.stdout.readline() == "SAVED 1\n" and proc.stdout.readline() == "SAVED 2\n"
    time.sleep(random.uniform(0, 0.2))
    proc.kill()
    proc.communicate()

    again = _spawn(d, rec, model_dir, 0, "--strict-check")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    report = json.loads(out.splitlines()[0].removeprefix("RESUMED "))
    assert report["resumed"] >= 2 and report["exact"], report
    assert "taking over the lock" in err
    # Weights load strictly: a missing or an unexpected tensor is an error naming it.
    assert "missing ['model.norm.weight'], unexpected []" in report["strict"]["missing"]
    assert "missing [], unexpected ['model.extra_head.weight']" in report["strict"]["unexpected"]
