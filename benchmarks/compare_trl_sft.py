"""This project's SFT trainer against TRL's SFTTrainer on identical data: seconds per step and final loss.

    uv run --with trl==1.16.0 benchmarks/compare_trl_sft.py [--steps 40] [--config PATH] [--warmup 3]
        [--sequential] [--json PATH] [--keep DIR] [--verbose] [key=value overrides of the SFT config ...]

Both sides read one SFT config (default: examples/configs/sft_math_tiny.yaml plus the overrides): the same
model, the same chats, batch size, max_length, AdamW settings, gradient clipping and a constant learning
rate (the config's scheduler is replaced by a constant one on both). (1) prepare: resolve the model (the
bootstrapped tiny base is built if not cached), tokenize the chats through the project's chat-template
path (``sft_data.tokenize_conversations``) and draw the project's batch order (``epoch_batches``); TRL is
given exactly those token ids, assistant-token labels and batches in that order (no shuffle of its own);
(2) this project (``train_sft``, the real trainer, checkpoints off), (3) TRL's ``SFTTrainer`` and a bare
PyTorch loop over the same batches (the floor: forward, backward, fused AdamW, nothing else) each run
in a subprocess with the same number of CPU threads; both set up side by side, then take turns, one step
each (the first mover swaps every step), so a load that changes on a shared machine changes under both
alike (``--sequential``: one whole side after the other); (4) one evaluator scores both saved models the
same way: per-token NLL of the held-out conversations' assistant tokens (HF forward).

Seconds per step: the project's is the driver's wall time of ``policy.train`` for the step (Ray round
trip, batch sharding, forward, backward, optimizer); TRL's from ``on_step_begin`` to ``on_step_end`` (its
forward, backward, optimizer and per-step metrics). Collation and logging are outside both. The first
``--warmup`` steps are left out of the means and medians. trl is a benchmark-only dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "examples" / "configs" / "sft_math_tiny.yaml"
TRL_PIN = "1.16.0"
# This project, TRL, and the bare PyTorch loop (the floor), each in its own process.
ROLES = ("ours", "trl", "bare")


def _config(path: str, overrides: list[str], steps: int) -> Any:
    from nemo_like.algorithms.sft import load_sft_config

    return load_sft_config(path, list(overrides) + [f"trainer.max_steps={steps}", "trainer.val_period=0",
                                                    "policy.scheduler.decay=constant",
                                                    "policy.scheduler.warmup_steps=0",
                                                    "checkpointing.enabled=false"])


# ------------------------------------------------------------------------------------------------
# (1) prepare
# ------------------------------------------------------------------------------------------------
def prepare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from nemo_like.algorithms.sft import load_sft_tokenizer, resolve_policy_model
    from nemo_like.algorithms.sft_loop import sft_batch
    from nemo_like.algorithms.trainer_base import epoch_batches
    from nemo_like.data.sft_data import read_conversations, tokenize_conversations
    from nemo_like.distributed.ray_cluster import init_ray, shutdown_ray_if_started

    cfg = _config(args.config, args.overrides, args.steps)
    started = init_ray(num_cpus=cfg.cluster.num_cpus)  # only used when the tiny base must be built
    try:
        model_dir = resolve_policy_model(cfg.policy.model_name)
    finally:
        shutdown_ray_if_started(started)
    tok = load_sft_tokenizer(cfg, model_dir)
    max_len = cfg.data.max_length or cfg.policy.max_total_sequence_length
    train = read_conversations(cfg.data.train, cfg.data.messages_key, "data.train")
    val = read_conversations(cfg.data.validation, cfg.data.messages_key, "data.validation")
    train_d, _ = tokenize_conversations(tok, train, max_len, cfg.data.train.path)
    val_d, _ = tokenize_conversations(tok, val, max_len, cfg.data.validation.path)
    gbs = cfg.policy.train_global_batch_size
    t = cfg.trainer
    order = [i for _, idx in epoch_batches(len(train), gbs, t.num_epochs, t.seed, t.max_steps) for i in idx]

    def rows(datums: list[dict]) -> list[dict[str, list[int]]]:
        b = sft_batch(datums, tok.pad_token_id)
        out = []
        for ids, mask, n, keep in zip(b["input_ids"], b["token_mask"], b["input_lengths"], b["sample_mask"]):
            ids, mask = ids[:n].tolist(), (mask[:n] * keep).long().tolist()
            out.append({"input_ids": ids, "labels": [i if m else -100 for i, m in zip(ids, mask)]})
        return out

    spec = {"model_dir": model_dir, "steps": len(order) // gbs, "gbs": gbs, "mbs": cfg.policy.train_micro_batch_size,
            "lr": cfg.policy.optimizer.lr, "weight_decay": cfg.policy.optimizer.weight_decay,
            "betas": list(cfg.policy.optimizer.betas), "eps": cfg.policy.optimizer.eps,
            "max_grad_norm": cfg.policy.max_grad_norm, "max_length": max_len, "seed": t.seed,
            "threads": int(cfg.cluster.num_workers * cfg.cluster.cpus_per_worker),
            "packing": cfg.policy.sequence_packing.enabled,
            "train": [rows([train_d[i]])[0] for i in order], "val": rows(val_d),
            "train_conversations": len(train), "val_conversations": len(val)}
    (work / "spec.json").write_text(json.dumps(spec))
    return spec


# ------------------------------------------------------------------------------------------------
# (2) this project, (3) TRL: each in its own process
# ------------------------------------------------------------------------------------------------
class _Turns:
    """A child's side of the lockstep: wait for "go" before a step, say "done" after it (no-ops when the
    run is sequential)."""

    def __init__(self, go: int | None, done: int | None):
        self.go, self.done = go, done

    def wait_go(self) -> None:
        if self.go is not None and os.read(self.go, 1) != b"G":
            sys.exit("compare_trl_sft: the orchestrator went away")

    def say_done(self) -> None:
        if self.done is not None:
            os.write(self.done, b"D")


def role_ours(args: argparse.Namespace, work: Path, turns: _Turns) -> None:
    import nemo_like.algorithms.sft as sft

    steps_fn = sft.sft_steps

    def in_turns(policy, batches, *, after_step=None, **kw):
        # Each step waits for its turn; its time (policy.train) starts after the wait.
        def gated():
            for item in batches:
                turns.wait_go()
                yield item

        def done(step, m):
            turns.say_done()
            if after_step is not None:
                after_step(step, m)

        return steps_fn(policy, gated(), after_step=done, **kw)

    sft.sft_steps = in_turns

    spec = json.loads((work / "spec.json").read_text())
    cfg = _config(args.config, args.overrides + [f"policy.model_name={spec['model_dir']}",
                                                 f"logger.log_dir={work / 'ours_logs'}", "logger.stdout_enabled=false",
                                                 "logger.tensorboard_enabled=false", f"output_dir={work / 'ours_model'}"],
                  args.steps)
    r = sft.train_sft(cfg)
    (work / "ours.json").write_text(json.dumps({"seconds": [h["seconds"] for h in r["history"]],
                                                "loss": [h["loss"] for h in r["history"]],
                                                "val_loss": r["last"].get("val/loss")}))


def role_trl(args: argparse.Namespace, work: Path, turns: _Turns) -> None:
    import torch
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    spec = json.loads((work / "spec.json").read_text())
    torch.set_num_threads(spec["threads"])
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    seconds, losses, t0 = [], [], [0.0]

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            turns.wait_go()
            t0[0] = time.perf_counter()

        def on_step_end(self, *a, **k):
            seconds.append(time.perf_counter() - t0[0])
            turns.say_done()

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    class InOrder(SFTTrainer):
        # The project's batches in the project's order: the rows are laid out batch after batch.
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    accum = max(spec["gbs"] // spec["mbs"], 1)
    targs = SFTConfig(output_dir=str(work / "trl_out"), per_device_train_batch_size=spec["gbs"] // accum,
                      gradient_accumulation_steps=accum, max_steps=spec["steps"], num_train_epochs=1,
                      learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
                      weight_decay=spec["weight_decay"], adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1],
                      adam_epsilon=spec["eps"], max_grad_norm=spec["max_grad_norm"] or 1e9,
                      max_length=spec["max_length"], packing=False, logging_steps=1, save_strategy="no",
                      report_to=[], use_cpu=True, bf16=False, fp16=False, seed=spec["seed"], dataloader_num_workers=0,
                      disable_tqdm=not args.verbose)
    trainer = InOrder(model=model, args=targs, train_dataset=Dataset.from_list(spec["train"]),
                      processing_class=tok, callbacks=[Timer()])
    trainer.train()
    trainer.save_model(str(work / "trl_model"))
    (work / "trl.json").write_text(json.dumps({"seconds": seconds, "loss": losses, "version": _trl_version()}))


def role_bare(args: argparse.Namespace, work: Path, turns: _Turns) -> None:
    """The floor: the same rows in the same batches through the plainest PyTorch loop (each batch
    right-padded to its longest row, HF's forward with labels, backward, clipping, fused AdamW), so
    the table shows what the model's arithmetic alone costs on these cores."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = json.loads((work / "spec.json").read_text())
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=tuple(spec["betas"]), eps=spec["eps"],
                            weight_decay=spec["weight_decay"], fused=True)
    seconds, losses, gbs = [], [], spec["gbs"]
    for step in range(spec["steps"]):
        rows = spec["train"][step * gbs:(step + 1) * gbs]
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in rows])
        labels = torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in rows])
        mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows])
        turns.wait_go()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        if spec["max_grad_norm"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["max_grad_norm"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        turns.say_done()
    (work / "bare.json").write_text(json.dumps({"seconds": seconds, "loss": losses}))


def _trl_version() -> str:
    import trl

    return trl.__version__


# ------------------------------------------------------------------------------------------------
# (4) one evaluator, orchestration and the table
# ------------------------------------------------------------------------------------------------
def held_out_nll(model_dir: str, rows: list[dict[str, list[int]]], threads: int) -> float:
    """Per-token NLL of the assistant tokens (labels != -100) of ``rows``: the same forward for both models."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(rows), 64):
            part = rows[s:s + 64]
            width = max(len(r["input_ids"]) for r in part)
            ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in part])
            labels = torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in part])
            attn = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in part])
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            target = labels[:, 1:]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target.clamp(min=0), reduction="none")
            keep = target != -100
            total += float(nll[keep].sum())
            count += int(keep.sum())
    return total / count


class _Child:
    """One side in its own subprocess; with ``lockstep`` a go pipe and a done pipe."""

    def __init__(self, role: str, args: argparse.Namespace, work: Path, lockstep: bool):
        self.role, self.log = role, work / f"{role}.log"
        cmd = [sys.executable, __file__, "--_role", role, "--_work", str(work), "--config", args.config,
               "--steps", str(args.steps)] + (["--verbose"] if args.verbose else [])
        self.go_w = self.done_r = None
        fds: tuple[int, ...] = ()
        if lockstep:
            go_r, self.go_w = os.pipe()
            self.done_r, done_w = os.pipe()
            fds = (go_r, done_w)
            cmd += ["--_go", str(go_r), "--_done", str(done_w)]
        print(f"[compare_trl_sft] {role}: started (load average {os.getloadavg()[0]:.1f}; log {self.log})", flush=True)
        self.t0 = time.perf_counter()
        self._fh = None if args.verbose else open(self.log, "w")  # noqa: SIM115 (open for the child's lifetime)
        self.proc = subprocess.Popen(cmd + args.overrides, stdout=self._fh, cwd=ROOT, pass_fds=fds,
                                     stderr=subprocess.STDOUT if self._fh else None)
        for fd in fds:  # the child's ends: closed here, so a child that dies reads as EOF
            os.close(fd)

    def step(self) -> None:
        os.write(self.go_w, b"G")
        if os.read(self.done_r, 1) != b"D":
            self.wait()

    def wait(self) -> float:
        rc = self.proc.wait()
        for fd in (self.go_w, self.done_r):
            if fd is not None:
                os.close(fd)
        self.go_w = self.done_r = None
        if self._fh:
            self._fh.close()
        if rc != 0:
            sys.exit(f"[compare_trl_sft] {self.role} failed (exit {rc}); see {self.log}:\n" + self.log.read_text()[-3000:])
        return time.perf_counter() - self.t0


def _run_sides(args: argparse.Namespace, work: Path, steps: int) -> dict[str, float]:
    if args.sequential:
        return {role: _Child(role, args, work, False).wait() for role in ROLES}
    sides = [_Child(role, args, work, True) for role in ROLES]
    for step in range(steps):
        for side in sides if step % 2 == 0 else sides[::-1]:
            side.step()
    return {side.role: side.wait() for side in sides}


def _stats(seconds: list[float], warmup: int) -> dict[str, float]:
    s = seconds[warmup:] or seconds
    return {"mean": statistics.fmean(s), "median": statistics.median(s)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--keep", default=None, help="work folder to keep (default: a temporary one, removed)")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--sequential", action="store_true", help="one whole side after the other, not in turns")
    p.add_argument("--_go", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_done", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_role", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_work", default=None, help=argparse.SUPPRESS)
    args, overrides = p.parse_known_args(argv)
    args.overrides = overrides
    if args._role:
        {"ours": role_ours, "trl": role_trl, "bare": role_bare}[args._role](args, Path(args._work),
                                                                            _Turns(args._go, args._done))
        return 0
    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="compare_trl_sft_")
    work = Path(args.keep or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    spec = prepare(args, work)
    wall = _run_sides(args, work, spec["steps"])
    ours, trl, bare = (json.loads((work / f"{r}.json").read_text()) for r in ROLES)
    val = {"ours": held_out_nll(str(work / "ours_model"), spec["val"], spec["threads"]),
           "trl": held_out_nll(str(work / "trl_model"), spec["val"], spec["threads"])}
    so, st, sb = (_stats(x["seconds"], args.warmup) for x in (ours, trl, bare))
    result = {"config": args.config, "overrides": args.overrides, "steps": spec["steps"], "global_batch_size": spec["gbs"],
              "max_length": spec["max_length"], "threads": spec["threads"], "packing_ours": spec["packing"],
              "lockstep": not args.sequential,
              "trl_version": trl["version"], "train_conversations": spec["train_conversations"],
              "val_conversations": spec["val_conversations"],
              "ours": {"s_per_step_mean": so["mean"], "s_per_step_median": so["median"], "first_loss": ours["loss"][0],
                       "final_train_loss": ours["loss"][-1], "held_out_nll": val["ours"], "wall_s": wall["ours"]},
              "trl": {"s_per_step_mean": st["mean"], "s_per_step_median": st["median"], "first_loss": trl["loss"][0],
                      "final_train_loss": trl["loss"][-1], "held_out_nll": val["trl"], "wall_s": wall["trl"]},
              "bare": {"s_per_step_mean": sb["mean"], "s_per_step_median": sb["median"], "first_loss": bare["loss"][0],
                       "final_train_loss": bare["loss"][-1], "wall_s": wall["bare"]},
              "ratio_mean": so["mean"] / st["mean"], "ratio_median": so["median"] / st["median"]}
    print(f"\n[compare_trl_sft] {spec['steps']} steps of {spec['gbs']} conversations (max_length {spec['max_length']}, "
          f"{spec['threads']} threads, project packing {'on' if spec['packing'] else 'off'}; TRL {trl['version']}, "
          f"padded batches; {'one after the other' if args.sequential else 'taking turns, one step each'}); "
          f"first {args.warmup} steps left out of the times")
    print(f"{'':8}{'s/step mean':>13}{'median':>9}{'step-1 loss':>13}{'last loss':>11}{'held-out NLL':>14}")
    for name in ROLES:
        r = result[name]
        nll = f"{r['held_out_nll']:14.4f}" if "held_out_nll" in r else f"{'-':>14}"
        print(f"{name:8}{r['s_per_step_mean']:13.3f}{r['s_per_step_median']:9.3f}{r['first_loss']:13.4f}"
              f"{r['final_train_loss']:11.4f}{nll}")
    print(f"ratio (ours / TRL): mean {result['ratio_mean']:.2f}x, median {result['ratio_median']:.2f}x "
          "(target <= 0.5x)")
    print(f"against the bare loop (median): ours {so['median'] / sb['median']:.2f}x, TRL {st['median'] / sb['median']:.2f}x")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
