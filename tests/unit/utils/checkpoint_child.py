"""A child process for the crash tests of test_checkpoint_safety.py. It resumes from its
checkpoint_dir, checks the resumed state against what was recorded before that save, then trains and
saves ``steps`` more steps. It dies by SIGKILL at a named point of a save when asked to
(``--kill-at POINT --kill-step N``), or whenever the test kills it.

Two kinds of run:
* default: a real GRPOTrainer (real config, sampler, checkpoint manager and an in-process HF policy
  worker on the tiny model) saving through ``GRPOTrainer.save_checkpoint`` and resuming through
  ``GRPOTrainer.load_checkpoint`` (weights, Adam state, scheduler, RNGs, data position);
* ``--light``: the same save protocol (init_tmp_checkpoint, policy files, save_train_state,
  finalize_checkpoint) with a small tensor "policy", for the many kills a test makes (no
  transformers import: a second per process instead of five).

Before each save, the state being saved is written to ``<records>/step_<N>.json`` (digests of the
weights, optimizer and RNG states, the sampler state, the step): a resume must reproduce it exactly.

    python checkpoint_child.py CKPT_DIR RECORDS MODEL_DIR STEPS [--light] [--kill-at P --kill-step N]
                               [--resave-step N] [--strict-check]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import sys
from pathlib import Path

import numpy as np
import torch

CONFIG = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_math_tiny.yaml"


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def digest(trainer, worker) -> dict:
    """The state a resume must reproduce, as comparable JSON."""
    w = hashlib.sha256()
    for name, t in sorted(worker.model.state_dict().items()):
        w.update(name.encode() + _tensor_bytes(t))
    o = hashlib.sha256()
    osd = worker.optimizer.state_dict()
    for idx in sorted(osd["state"]):
        for key, value in sorted(osd["state"][idx].items()):
            o.update(f"{idx}/{key}".encode() + _tensor_bytes(torch.as_tensor(value)))
    name, keys, pos, has_gauss, cached = np.random.get_state()
    r = hashlib.sha256(repr(random.getstate()).encode() + keys.tobytes() + repr((name, pos, has_gauss, cached)).encode()
                       + _tensor_bytes(torch.get_rng_state()))
    return {"step": trainer.step_count, "weights": w.hexdigest(), "optimizer": o.hexdigest(),
            "lr": [g["lr"] for g in osd["param_groups"]], "scheduler_epoch": worker.scheduler.last_epoch,
            "rng": r.hexdigest(), "sampler": trainer.sampler.state_dict(), "last_val_metrics": trainer.last_val_metrics,
            "first_val_results": trainer.first_val_results, "last_val_results": trainer.last_val_results}


def build(ckpt_dir: str, model_dir: str, log_dir: str):
    from nemo_like.algorithms.grpo import GRPOTrainer
    from nemo_like.algorithms.loss_functions import ClippedPGLossFn
    from nemo_like.config import load_config
    from nemo_like.data.sampler import EpochSampler
    from nemo_like.models.policy.hf_worker import HFPolicyWorker
    from nemo_like.utils.checkpoint import CheckpointManager
    from nemo_like.utils.logger import Logger

    cfg = load_config(str(CONFIG), [f"policy.model_name={model_dir}", "bootstrap.enabled=false", "grpo.dynamic_sampling.enabled=false",
                                    f"checkpointing.checkpoint_dir={ckpt_dir}", "checkpointing.keep_top_k=2",
                                    "checkpointing.metric_name=null", f"logger.log_dir={log_dir}"])
    with socket.socket() as s:  # one process group of one rank, on a port no sibling child uses
        s.bind(("127.0.0.1", 0))
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    worker = HFPolicyWorker(cfg.policy, seed=0, init_reference_model=False)
    logger = Logger({"log_dir": log_dir, "stdout_enabled": False, "jsonl_enabled": False,
                     "tensorboard_enabled": False})
    trainer = GRPOTrainer(config=cfg, policy=worker, tokenizer=worker.tokenizer, train_dataset=None,
                          val_dataset=None, envs={}, logger=logger, checkpointer=CheckpointManager(cfg.checkpointing),
                          sampler=EpochSampler(50, seed=0), loss_fn=ClippedPGLossFn(cfg.loss_fn))
    return trainer, worker


def train_one_step(trainer, worker) -> None:
    """Changes everything a checkpoint holds: weights, Adam moments, lr, RNGs, data position."""
    for p in worker.model.parameters():
        p.grad = torch.randn_like(p)
    worker.optimizer.step()
    worker.scheduler.step()
    trainer.sampler.next_indices(7)
    random.random()
    np.random.rand()
    trainer.step_count += 1
    trainer.last_val_metrics = {"val/accuracy": trainer.step_count / 100}
    trainer.last_val_results = {"task_name": ["math"] * 3, "correct": [True, trainer.step_count % 2 == 0, False]}
    trainer.first_val_results = trainer.first_val_results or trainer.last_val_results


def strict_check(worker, latest: Path, scratch: Path) -> dict:
    """Loads the weights with one tensor removed, then with one added; returns the errors."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = {}
    for case in ("missing", "unexpected"):
        d = scratch / case
        shutil.copytree(latest / "policy", d)
        (shard,) = d.glob("*.safetensors")
        sd = load_file(str(shard))
        if case == "missing":
            sd.pop("model.norm.weight")
        else:
            sd["model.extra_head.weight"] = torch.zeros(2, 2)
        save_file(sd, str(shard), metadata={"format": "pt"})
        try:
            worker.load_checkpoint(str(d))
            out[case] = None
        except RuntimeError as e:
            out[case] = str(e)
    return out


class LightRun:
    """What GRPOTrainer checkpoints, in miniature: weights, optimizer state, RNGs, data position."""

    def __init__(self, ckpt_dir: str):
        from nemo_like.utils.checkpoint import CheckpointManager

        self.checkpointer = CheckpointManager({"checkpoint_dir": ckpt_dir, "keep_top_k": 2, "metric_name": None})
        self.step_count, self.position = 0, 0
        self.weights = {"layer.weight": torch.zeros(32, 32), "layer.bias": torch.zeros(32)}
        self.moments = {k: torch.zeros_like(v) for k, v in self.weights.items()}

    def train_one_step(self) -> None:
        for k, v in self.weights.items():
            g = torch.randn_like(v)
            self.moments[k] = 0.9 * self.moments[k] + 0.1 * g
            v -= 0.01 * self.moments[k]
        random.random()
        np.random.rand()
        self.position += 7
        self.step_count += 1

    def digest(self) -> dict:
        w = hashlib.sha256(b"".join(k.encode() + _tensor_bytes(v) for k, v in sorted(self.weights.items())))
        o = hashlib.sha256(b"".join(k.encode() + _tensor_bytes(v) for k, v in sorted(self.moments.items())))
        name, keys, pos, has_gauss, cached = np.random.get_state()
        r = hashlib.sha256(repr(random.getstate()).encode() + keys.tobytes()
                           + repr((name, pos, has_gauss, cached)).encode() + _tensor_bytes(torch.get_rng_state()))
        return {"step": self.step_count, "weights": w.hexdigest(), "optimizer": o.hexdigest(), "rng": r.hexdigest(),
                "position": self.position}

    def save_checkpoint(self) -> Path:
        from safetensors.torch import save_file

        from nemo_like.utils.checkpoint import save_train_state

        tmp = self.checkpointer.init_tmp_checkpoint(self.step_count, {"metrics": {}})
        (tmp / "policy").mkdir()
        save_file(self.weights, str(tmp / "policy" / "model.safetensors"))
        torch.save({"optimizer": {"state": self.moments, "param_groups": [{"lr": 0.01, "betas": (0.9, 0.99)}]},
                    "scheduler": {"last_epoch": self.step_count}}, tmp / "policy" / "optimizer.pt")
        save_train_state(tmp, {"step": self.step_count, "sampler": {"epoch": 0, "position": self.position}})
        return self.checkpointer.finalize_checkpoint(tmp)

    def load_checkpoint(self, path: Path) -> None:
        from safetensors.torch import load_file

        from nemo_like.utils.checkpoint import load_train_state, restore_rng

        state = load_train_state(path)
        self.weights = load_file(str(path / "policy" / "model.safetensors"))
        self.moments = torch.load(path / "policy" / "optimizer.pt", weights_only=True)["optimizer"]["state"]
        self.step_count, self.position = int(state["step"]), int(state["sampler"]["position"])
        restore_rng(state["rng"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt_dir")
    ap.add_argument("records")
    ap.add_argument("model_dir")
    ap.add_argument("steps", type=int)
    ap.add_argument("--kill-at")
    ap.add_argument("--kill-step", type=int)
    ap.add_argument("--strict-check", action="store_true")
    ap.add_argument("--light", action="store_true")
    ap.add_argument("--resave-step", type=int)
    args = ap.parse_args()
    records = Path(args.records)
    records.mkdir(parents=True, exist_ok=True)
    if args.light:
        run = LightRun(args.ckpt_dir)
        state_of, train, save = run.digest, run.train_one_step, run.save_checkpoint
    else:
        run, worker = build(args.ckpt_dir, args.model_dir, str(records / "logs"))
        state_of, train = (lambda: digest(run, worker)), (lambda: train_one_step(run, worker))
        save = lambda: run.save_checkpoint({"train/loss": float(run.step_count)})  # noqa: E731

    latest = run.checkpointer.open_for_run(resume=True)
    report: dict = {"resumed": None}
    if latest is not None:
        run.load_checkpoint(latest)
        expected = json.loads((records / f"step_{run.step_count}.json").read_text())
        report = {"resumed": run.step_count, "exact": state_of() == expected}
        if args.strict_check:
            report["strict"] = strict_check(worker, latest, records / "strict")
    print("RESUMED " + json.dumps(report), flush=True)

    from nemo_like.utils import checkpoint_io

    for _ in range(args.steps):
        train()
        step = run.step_count
        tmp = records / f"step_{step}.json.tmp"
        tmp.write_text(json.dumps(state_of()))
        os.replace(tmp, records / f"step_{step}.json")
        for again in range(2 if step == args.resave_step else 1):  # a second save of a step replaces the first
            if step == args.kill_step and again == (step == args.resave_step):
                def die(point: str, target: str = args.kill_at) -> None:
                    if point == target:
                        os.kill(os.getpid(), signal.SIGKILL)
                checkpoint_io.FAULT_HOOK = die
            save()
        print(f"SAVED {step}", flush=True)
    run.checkpointer.release_lock()
    sys.exit(0)


if __name__ == "__main__":
    main()
