"""This project against TRL's GRPOTrainer on the same GRPO work: seconds per step and held-out accuracy.

    uv run --with trl==1.16.0 benchmarks/compare_trl.py [--steps 60] [--config PATH] [--val-samples N]
        [--warmup 2] [--skip-trl] [--skip-project] [--sequential] [--json PATH] [--keep DIR] [--verbose]
        [key=value overrides for the project config ...]

Both sides read one project config (default: examples/configs/grpo_math_tiny.yaml, plus the
key=value overrides), so they train the same base model on the same prompts in the same order,
with the same group size, batch sizes, completion length, sampling temperature, learning-rate
schedule, clipping, loss normalisation and verifier. Every part runs in its own subprocess:
(1) prepare: resolve the model and render the prompts through the project's own dataset and
processor path; (2) this project (`GRPOExperiment`, validation at start and end) and (3) TRL's
`GRPOTrainer` (trl is a benchmark-only dependency: `uv run --with trl==...`); (4) one evaluator
grades the base model and both final models the same way (HF greedy `generate`, the project's
verifier) on the held-out problems.

(2) and (3) set up side by side, then take turns, one GRPO step each (the first mover swaps every
step): on a machine shared with other work the load then changes under both alike. `--sequential`
runs one whole side after the other instead.

A GRPO step = one generation of prompts x G completions + the optimizer steps over them. The
project's time is its own `timing/total` (and, for reference, the wall time of `exp.step()`); TRL's
is the wall time from its turn's start to the `on_step_end` of the GRPO step's last optimizer step
(generation, data loading and logging included). The first `--warmup` steps are left out of the
means and medians on both sides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"
TRL_PIN = "1.16.0"
HOW_TO_RUN = f"uv run --with trl=={TRL_PIN} benchmarks/compare_trl.py [--steps 60] [key=value ...]"


# ================================================================================================
# shared helpers
# ================================================================================================
def _read(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def _write(path: Path, obj: Any) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _load_cfg(req: dict):
    from nemo_like.config import load_config

    return load_config(req["config"], req["overrides"])


def _training_threads(cfg) -> int:
    """CPU threads the project's training uses: the policy's own setting, else each worker's CPU share
    (a one-worker run: all of it). TRL runs in one process, so it gets the total over the workers."""
    per_worker = cfg.policy.num_threads or max(1, int(cfg.cluster.cpus_per_worker))
    return int(per_worker * cfg.cluster.num_workers)


def _limit_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(max(1, n))
    except RuntimeError:  # already set: intra-op threads are what matter here
        pass


def _summary(times: list[float], warmup: int) -> dict[str, Any]:
    kept = times[warmup:]
    return {"n": len(kept), "mean": statistics.mean(kept) if kept else float("nan"),
            "median": statistics.median(kept) if kept else float("nan"),
            "min": min(kept) if kept else float("nan"), "max": max(kept) if kept else float("nan"),
            "first": times[0] if times else float("nan")}


class _Turns:
    """Step-by-step turn taking with the orchestrator: a side says it is ready, then runs one GRPO
    step per "go" and answers "done", so the two sides alternate and share whatever load the machine
    has at the time. Without pipes (--sequential) every call returns at once."""

    def __init__(self, go_fd: int | None, done_fd: int | None) -> None:
        self.go, self.done_fd = go_fd, done_fd

    def _say(self, b: bytes) -> None:
        if self.done_fd is not None:
            try:
                os.write(self.done_fd, b)
            except BrokenPipeError:
                raise SystemExit("compare_trl: the orchestrator went away") from None

    def ready(self) -> None:
        self._say(b"R")

    def done(self) -> None:
        self._say(b"D")

    def wait_go(self) -> None:
        if self.go is None:
            return
        b = os.read(self.go, 1)
        if b != b"G":
            raise SystemExit(f"compare_trl: the orchestrator went away (got {b!r} instead of a go)")


# ================================================================================================
# role: prepare (model path, prompts, held-out set, hyper-parameters; all from the project config)
# ================================================================================================
def _wait_for_other_builder(out: Path) -> None:
    """Another process may be building this very base model right now (its `<out>.tmp<pid>` folder
    exists and that pid lives): wait for it rather than training a second copy."""
    announced = False
    while not (out / "config.json").exists():
        live = []
        for tmp in out.parent.glob(f"{out.name}.tmp*"):
            pid = tmp.name.rsplit(".tmp", 1)[-1]
            if pid.isdigit():
                try:
                    os.kill(int(pid), 0)
                    live.append(pid)
                except (ProcessLookupError, PermissionError):
                    pass
        if not live:
            return
        if not announced:
            print(f"[prepare] process {', '.join(live)} is building the base model {out}; waiting for it", flush=True)
            announced = True
        time.sleep(10)


def _resolve_model(cfg) -> tuple[str, str]:
    if cfg.bootstrap is not None and cfg.bootstrap.enabled:
        from nemo_like.models.bootstrap import bootstrap_cache_path, ensure_base_model

        out = bootstrap_cache_path(cfg)
        _wait_for_other_builder(out)
        if not ((out / "config.json").exists() and (out / "tokenizer.json").exists()):
            from nemo_like.distributed.ray_cluster import (
                init_ray,
                shutdown_ray_if_started,
            )

            print(f"[prepare] building the bootstrapped base model into {out} (once)", flush=True)
            started = init_ray(address=cfg.cluster.address, num_cpus=cfg.cluster.num_cpus)
            try:
                path = ensure_base_model(cfg)
            finally:
                shutdown_ray_if_started(started)
            return path, path
        return str(out), str(out)
    try:
        from nemo_like.models.pretrained import resolve_model_source
    except ImportError:  # older trees: hub ids and folders only
        def resolve_model_source(name: str) -> str:
            return name
    model = resolve_model_source(cfg.policy.model_name)
    tok = resolve_model_source(cfg.policy.tokenizer_name) if cfg.policy.tokenizer_name else model
    return model, tok


def _rows(dataset, indices) -> list[dict[str, Any]]:
    out = []
    for i in indices:
        d = dataset[i]
        log = d["message_log"]
        ids = [int(t) for m in log for t in m["token_ids"].tolist()]
        out.append({"idx": int(i), "text": "".join(m["content"] for m in log), "ids": ids,
                    "ground_truth": str(d["extra_env_info"]["ground_truth"]),
                    "truncated": float(d["loss_multiplier"]) == 0.0})
    return out


def role_prepare(work: Path) -> None:
    from transformers import AutoTokenizer

    from nemo_like.algorithms.grpo import build_task_dataset, make_train_sampler
    from nemo_like.data.datasets import load_dataset_from_config

    req = _read(work / "request.json")
    cfg = _load_cfg(req)
    g, p, lf = cfg.grpo, cfg.policy, cfg.loss_fn
    problems = []
    for c in cfg.data.train_list + cfg.data.validation_list:
        if c.env_name != "math" or c.reward_fns:
            problems.append(f"task {c.task_name!r} is graded by {c.env_name!r}"
                            f"{' with reward_fns' if c.reward_fns else ''}, not the math verifier")
    if cfg.env.get("math", {}).get("verifier"):
        problems.append("env.math.verifier is set; this benchmark grades with verify_math_answer only")
    if g.max_rollout_turns != 1:
        problems.append(f"grpo.max_rollout_turns={g.max_rollout_turns}: TRL's side here is single-turn")
    if g.advantage_estimator != "grpo":
        problems.append(f"grpo.advantage_estimator={g.advantage_estimator!r}: only 'grpo' has a TRL twin")
    if not cfg.data.validation_list:
        problems.append("the config has no data.validation set to measure held-out accuracy on")
    if problems:
        raise SystemExit("compare_trl: this config cannot be compared with TRL: " + "; ".join(problems))

    model_path, tok_path = _resolve_model(cfg)
    tok = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=p.trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    max_in = cfg.data.max_input_seq_length
    train_cfgs, val_cfgs = cfg.data.train_list, cfg.data.validation_list
    train_ds = build_task_dataset(train_cfgs, [load_dataset_from_config(c) for c in train_cfgs], tok, max_in)
    val_ds = build_task_dataset(val_cfgs, [load_dataset_from_config(c) for c in val_cfgs], tok, max_in)

    # The prompts the project will draw, in its order: its sampler is seeded by grpo.seed alone.
    sampler = make_train_sampler(train_cfgs, train_ds, g.seed)
    order = [i for _ in range(req["steps"]) for i in sampler.next_indices(g.num_prompts_per_step)]
    cap = g.max_val_samples
    val_idx = (val_ds.first_indices(cap) if hasattr(val_ds, "first_indices") else range(min(len(val_ds), cap)))

    completions = g.num_prompts_per_step * g.num_generations_per_prompt
    train_rows, val_rows = _rows(train_ds, order), _rows(val_ds, val_idx)
    budget_short = sum(1 for r in train_rows + val_rows
                       if p.max_total_sequence_length - len(r["ids"]) < p.generation.max_new_tokens)
    spec = {
        "config": req["config"], "overrides": req["overrides"], "user_overrides": req["user_overrides"],
        "steps": req["steps"],
        "model_path": model_path, "tokenizer_path": tok_path,
        "eos_token_id": tok.eos_token_id, "eos_token": tok.eos_token, "pad_token_id": tok.pad_token_id,
        "threads": _training_threads(cfg),
        "hp": {
            "num_prompts_per_step": g.num_prompts_per_step, "num_generations": g.num_generations_per_prompt,
            "completions_per_step": completions, "train_global_batch_size": p.train_global_batch_size,
            "train_micro_batch_size": p.train_micro_batch_size,
            "optimizer_steps_per_step": completions // p.train_global_batch_size,
            "max_new_tokens": p.generation.max_new_tokens, "max_total_sequence_length": p.max_total_sequence_length,
            "max_input_seq_length": max_in, "temperature": p.generation.temperature,
            "top_p": p.generation.top_p, "top_k": p.generation.top_k or 0,
            "stop_strings": p.generation.stop_strings,
            "lr": p.optimizer.lr, "betas": list(p.optimizer.betas), "eps": p.optimizer.eps,
            "weight_decay": p.optimizer.weight_decay, "scheduler": p.scheduler.model_dump(),
            "max_grad_norm": p.max_grad_norm, "precision": p.precision,
            "kl": lf.reference_policy_kl_penalty, "clip_low": lf.ratio_clip_min, "clip_high": lf.ratio_clip_max,
            "dual_clip_c": lf.ratio_clip_c, "token_level_loss": lf.token_level_loss,
            "importance_sampling_correction": lf.use_importance_sampling_correction,
            "std_scale": g.std_scale, "leave_one_out": g.use_leave_one_out_baseline,
            "overlong_filtering": g.overlong_filtering, "seed": g.seed,
            "num_workers": cfg.cluster.num_workers, "cpus_per_worker": cfg.cluster.cpus_per_worker,
            "gpus_per_worker": cfg.cluster.gpus_per_worker,
            "generation_batch_size": p.generation_batch_size, "trust_remote_code": p.trust_remote_code,
            "reuse_generation_logprobs": g.reuse_generation_logprobs, "logprob_check_period": g.logprob_check_period,
        },
        "train": train_rows, "val": val_rows,
        "prompts_truncated": sum(r["truncated"] for r in train_rows + val_rows),
        "prompts_with_short_budget": budget_short,
    }
    _write(work / "spec.json", spec)
    print(f"[prepare] model {model_path}; {len(train_rows)} train prompts, {len(val_rows)} held-out", flush=True)


# ================================================================================================
# role: project
# ================================================================================================
def _policy_worker_nice() -> int | None:
    """Scheduling niceness of this run's policy worker (Ray starts its workers at RAY_worker_niceness,
    15 by default): under load from other work, a niced process gets a smaller share of the CPUs."""
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            if "HFPolicyWorker" in " ".join(child.cmdline()[:1]) or "HFPolicyWorker" in child.name():
                return int(child.nice())
    except Exception:  # noqa: BLE001 (a missing psutil or a vanished process: unknown, not fatal)
        return None
    return None


def role_project(work: Path, turns: _Turns) -> None:
    from nemo_like import GRPOExperiment

    spec = _read(work / "spec.json")
    t_setup = time.perf_counter()
    exp = GRPOExperiment.from_config(spec["config"], spec["overrides"], resume=False)
    try:
        setup_s = time.perf_counter() - t_setup
        if os.path.realpath(exp.config.policy.model_name) != os.path.realpath(spec["model_path"]):
            raise SystemExit(f"project side loaded {exp.config.policy.model_name}, the spec says {spec['model_path']}")
        t0 = time.perf_counter()
        v0 = exp.validate()
        val0_s = time.perf_counter() - t0
        correct0 = list(exp.trainer.last_val_results["correct"])
        walls, loads = [], []
        worker_nice = _policy_worker_nice()
        turns.ready()
        for _ in range(spec["steps"]):
            turns.wait_go()
            t = time.perf_counter()
            exp.step()
            walls.append(time.perf_counter() - t)
            loads.append(os.getloadavg()[0])
            turns.done()
        t0 = time.perf_counter()
        v1 = exp.validate()
        val1_s = time.perf_counter() - t0
        correct1 = list(exp.trainer.last_val_results["correct"])
        rows = [h for h in exp.trainer.history if "timing/total" in h]
        exp.trainer.policy.save_checkpoint(str(work / "project_final"))
    finally:
        exp.close()
    _write(work / "project.json", {
        "setup_s": setup_s, "val_s": [val0_s, val1_s], "load_avg": loads, "worker_nice": worker_nice,
        "step_total": [float(r["timing/total"]) for r in rows], "step_wall": walls,
        "phases": {k: [float(r[k]) for r in rows if k in r]
                   for k in sorted({k for r in rows for k in r if k.startswith("timing/")})},
        "reward_mean": [float(r["train/reward_mean"]) for r in rows],
        "response_length_mean": [float(r.get("train/response_length_mean", float("nan"))) for r in rows],
        "val_acc": [v0["val/accuracy"], v1["val/accuracy"]], "val_correct": [correct0, correct1],
        "final_model": str(work / "project_final"),
    })


# ================================================================================================
# role: trl
# ================================================================================================
def _trl_loss_type(hp: dict) -> str:
    # token_level_loss: every token of the global batch weighs the same (a global token mean), what
    # TRL calls "dapo"; otherwise each sample's token mean, averaged over samples ("grpo").
    return "dapo" if hp["token_level_loss"] else "grpo"


def _trl_scale_rewards(hp: dict) -> str:
    return {"group": "group", "batch": "batch", None: "none"}[hp["std_scale"]]


def role_trl(work: Path, turns: _Turns) -> None:
    spec = _read(work / "spec.json")
    hp = spec["hp"]
    _limit_threads(spec["threads"])
    nice = os.environ.get("COMPARE_TRL_NICE")
    if nice is not None:  # the project's compute runs in a Ray worker at this niceness: same priority here
        os.nice(int(nice) - os.nice(0))

    import torch
    import trl
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        PrinterCallback,
        ProgressCallback,
        TrainerCallback,
    )
    from trl import GRPOConfig, GRPOTrainer

    from nemo_like.environments.math_environment import verify_math_answer
    from nemo_like.models.policy.interfaces import SchedulerConfig

    tok = AutoTokenizer.from_pretrained(spec["tokenizer_path"], trust_remote_code=hp["trust_remote_code"])
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32,
                                                 trust_remote_code=hp["trust_remote_code"])

    rows = spec["train"]
    texts = [r["text"] for r in rows]
    # TRL tokenizes a plain-text prompt itself (tokenizer(text)): check it gets the project's ids.
    trl_ids = tok(text=texts)["input_ids"]
    ids_differ = sum(1 for a, r in zip(trl_ids, rows) if list(a) != r["ids"])
    dataset = Dataset.from_dict({"prompt": texts, "ground_truth": [r["ground_truth"] for r in rows]})

    def math_accuracy(completions, ground_truth, **_: Any) -> list[float]:
        return [verify_math_answer(c, t) for c, t in zip(completions, ground_truth)]

    per_step = hp["optimizer_steps_per_step"]
    # TRL turns activation ("gradient") checkpointing on by default; the project's default is off.
    # Newer transformers name it activation_checkpointing (the old name still works, with a warning).
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    ckpt_off = {"activation_checkpointing": False} if "activation_checkpointing" in names else {
        "gradient_checkpointing": False}
    args = GRPOConfig(
        output_dir=str(work / "trl_out"),
        # batching: one generation of prompts x G completions, `per_step` optimizer steps over it
        per_device_train_batch_size=hp["train_global_batch_size"],
        gradient_accumulation_steps=1,
        steps_per_generation=per_step,
        num_generations=hp["num_generations"],
        num_iterations=1,
        max_steps=spec["steps"] * per_step,
        shuffle_dataset=False,  # the rows are already the project's prompts in the project's order
        # sampling
        max_completion_length=hp["max_new_tokens"],
        temperature=hp["temperature"], top_p=hp["top_p"], top_k=hp["top_k"],
        # loss
        beta=hp["kl"], epsilon=hp["clip_low"], epsilon_high=hp["clip_high"],
        loss_type=_trl_loss_type(hp), scale_rewards=_trl_scale_rewards(hp),
        mask_truncated_completions=hp["overlong_filtering"],
        # optimisation (the optimizer and its schedule are passed in below; these keep the record straight)
        learning_rate=hp["lr"], adam_beta1=hp["betas"][0], adam_beta2=hp["betas"][1], adam_epsilon=hp["eps"],
        weight_decay=hp["weight_decay"], max_grad_norm=hp["max_grad_norm"] or 0.0,
        # machine and bookkeeping
        use_cpu=not hp.get("gpus_per_worker"), bf16=hp["precision"] == "bfloat16", fp16=hp["precision"] == "float16",
        **ckpt_off, seed=hp["seed"], report_to="none", save_strategy="no",
        eval_strategy="no", logging_steps=per_step, disable_tqdm=True, dataloader_num_workers=0,
        dataloader_pin_memory=False,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"],
                                  weight_decay=hp["weight_decay"])
    # The project's own schedule function (warm-up, decay shape, floor, length in optimizer steps).
    sched_cfg = SchedulerConfig(**hp["scheduler"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: sched_cfg.lr_factor(s))

    steps = spec["steps"]

    class StepClock(TrainerCallback):
        """GRPO step j runs from the go (the first: at on_train_begin) to the on_step_end of optimizer
        step j * per_step, so it holds the generation and all the optimizer steps over it (and
        whatever the trainer does in between: data loading, logging)."""

        def __init__(self) -> None:
            self.t_start = 0.0
            self.step_wall: list[float] = []
            self.opt_ends: list[float] = []
            self.lrs: list[float] = []
            self.loads: list[float] = []
            self.threads = None

        def on_train_begin(self, args, state, control, **kw):
            self.threads = torch.get_num_threads()
            turns.ready()
            turns.wait_go()
            self.t_start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.opt_ends.append(now - self.t_start)
            self.lrs.append(float(optimizer.param_groups[0]["lr"]))
            if state.global_step % per_step == 0:
                self.step_wall.append(now - self.t_start)
                self.loads.append(os.getloadavg()[0])
                turns.done()
                if len(self.step_wall) < steps:
                    turns.wait_go()
                self.t_start = time.perf_counter()

    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=[math_accuracy], args=args, train_dataset=dataset,
                          processing_class=tok, optimizers=(optimizer, scheduler), callbacks=[clock])
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    eos_ids = list(getattr(trainer, "eos_token_ids", [tok.eos_token_id]))
    trainer.train()
    if len(clock.step_wall) != steps:
        raise SystemExit(f"TRL ran {len(clock.step_wall)} GRPO steps, expected {steps}")
    final = work / "trl_final"
    trainer.model.save_pretrained(str(final), safe_serialization=True)
    tok.save_pretrained(str(final))

    logs = [h for h in trainer.state.log_history if "reward" in h]
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    _write(work / "trl.json", {
        "trl_version": trl.__version__, "step_wall": clock.step_wall, "load_avg": clock.loads, "nice": os.nice(0),
        "optimizer_step_end_s": clock.opt_ends, "lr": clock.lrs, "threads_in_training": clock.threads,
        "activation_checkpointing": bool(getattr(args, "activation_checkpointing", args.gradient_checkpointing)),
        "reward_mean": [float(h["reward"]) for h in logs],
        "response_length_mean": [float(h.get("completions/mean_length", float("nan"))) for h in logs],
        "prompt_ids_differ": ids_differ, "eos_token_ids": eos_ids, "final_model": str(final),
        "optim": type(inner).__name__,
    })


# ================================================================================================
# role: eval (one evaluator for every model: HF greedy generate, the project's verifier)
# ================================================================================================
def _greedy_correct(model_dir: str, spec: dict) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from nemo_like.environments.math_environment import verify_math_answer

    hp = spec["hp"]
    tok = AutoTokenizer.from_pretrained(spec["tokenizer_path"], trust_remote_code=hp["trust_remote_code"])
    device = "cuda" if hp.get("gpus_per_worker") and torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 trust_remote_code=hp["trust_remote_code"]).to(device).eval()
    eos, pad = spec["eos_token_id"], spec["pad_token_id"]
    rows, bs = spec["val"], max(1, hp["generation_batch_size"])
    correct, lengths, t0 = [], [], time.perf_counter()
    for start in range(0, len(rows), bs):
        chunk = rows[start:start + bs]
        width = max(len(r["ids"]) for r in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, r in enumerate(chunk):  # left padding: prompts flush against what is generated
            ids[i, width - len(r["ids"]):] = torch.tensor(r["ids"])
            attn[i, width - len(r["ids"]):] = 1
        # Each prompt's own budget, as in the project: max_new_tokens within max_total_sequence_length.
        budgets = [min(hp["max_new_tokens"], hp["max_total_sequence_length"] - len(r["ids"])) for r in chunk]
        gc = GenerationConfig(max_new_tokens=max(budgets), do_sample=False, eos_token_id=eos, pad_token_id=pad,
                              stop_strings=hp["stop_strings"] or None)
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), generation_config=gc,
                                 **({"tokenizer": tok} if hp["stop_strings"] else {}))
        out = out.cpu()
        for i, r in enumerate(chunk):
            gen = out[i, width:width + budgets[i]].tolist()
            if eos in gen:
                gen = gen[:gen.index(eos) + 1]
            lengths.append(len(gen))
            text = tok.decode(gen, skip_special_tokens=True)
            correct.append(verify_math_answer(text, r["ground_truth"]) >= 1.0)
    return {"accuracy": sum(correct) / max(1, len(correct)), "correct": correct,
            "response_length_mean": sum(lengths) / max(1, len(lengths)), "seconds": time.perf_counter() - t0}


def role_eval(work: Path) -> None:
    spec = _read(work / "spec.json")
    _limit_threads(spec["threads"])
    models = {"base": spec["model_path"]}
    for side in ("project", "trl"):
        if (work / f"{side}_final" / "config.json").exists():
            models[side] = str(work / f"{side}_final")
    out = {}
    for name, path in models.items():
        out[name] = _greedy_correct(path, spec)
        print(f"[eval] {name}: {out[name]['accuracy']:.1%} ({out[name]['seconds']:.1f} s)", flush=True)
    _write(work / "eval.json", out)


# ================================================================================================
# orchestrator
# ================================================================================================
def _trl_available() -> str | None:
    try:
        import trl
    except (ImportError, RuntimeError, AttributeError):  # absent, or broken against this transformers
        return None
    return getattr(trl, "__version__", "?")


class _Child:
    """One role in its own subprocess; with ``lockstep`` it also gets a go pipe and a done pipe."""

    def __init__(self, role: str, work: Path, verbose: bool, lockstep: bool, env_extra: dict[str, str] | None = None):
        self.role, self.log = role, work / f"{role}.log"
        env = dict(os.environ) | (env_extra or {})
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_role", role, "--_work", str(work)]
        self.go_w = self.done_r = None
        child_fds: tuple[int, ...] = ()
        if lockstep:
            go_r, self.go_w = os.pipe()
            self.done_r, done_w = os.pipe()
            child_fds = (go_r, done_w)
            cmd += ["--_go", str(go_r), "--_done", str(done_w)]
        print(f"[compare_trl] {role}: started (load average {os.getloadavg()[0]:.1f}; log {self.log})", flush=True)
        self.t0 = time.perf_counter()
        self._fh = None if verbose else open(self.log, "w")  # noqa: SIM115 (open for the child's lifetime)
        self.proc = subprocess.Popen(cmd, stdout=self._fh, stderr=subprocess.STDOUT if self._fh else None,
                                     env=env, cwd=ROOT, pass_fds=child_fds)
        for fd in child_fds:  # the child's ends: closed here, so a child that dies reads as EOF
            os.close(fd)
        self.seconds = 0.0

    def expect(self, what: bytes) -> None:
        assert self.done_r is not None
        got = os.read(self.done_r, 1)
        if got != what:
            self.proc.wait()
            self.fail()

    def go(self) -> None:
        assert self.go_w is not None
        os.write(self.go_w, b"G")

    def close_pipes(self) -> None:
        for fd in (self.go_w, self.done_r):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.go_w = self.done_r = None

    def wait(self) -> float:
        rc = self.proc.wait()
        self.close_pipes()
        if self._fh:
            self._fh.close()
        if rc != 0:
            self.fail()
        self.seconds = time.perf_counter() - self.t0
        print(f"[compare_trl] {self.role}: done in {self.seconds:.0f} s (load average now {os.getloadavg()[0]:.1f})",
              flush=True)
        return self.seconds

    def fail(self) -> None:
        if self.log.exists():
            tail = self.log.read_text(errors="replace").splitlines()[-40:]
            print("\n".join(f"  | {line}" for line in tail), file=sys.stderr)
        raise SystemExit(f"compare_trl: the {self.role} step failed (exit {self.proc.returncode}); log: {self.log}")

    def stop(self) -> None:
        """After a failure elsewhere: EOF on its go pipe lets the child shut down (Ray included) by
        itself; it is terminated only if it does not."""
        self.close_pipes()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait()


def _run_sides(roles: list[str], work: Path, steps: int, verbose: bool, sequential: bool,
               env_for: dict[str, dict[str, str]]) -> dict[str, float]:
    """Run the training sides. Alternating (the default): both start, set up (untimed) and then take
    turns, one GRPO step each, the first mover swapping every step, so a change in the machine's
    load lands on both. Sequential: one whole side after the other."""
    out: dict[str, float] = {}
    if sequential or len(roles) == 1:
        for role in roles:
            child = _Child(role, work, verbose, lockstep=False, env_extra=env_for.get(role))
            try:
                out[role] = child.wait()
            except BaseException:
                if child.proc.poll() is None:  # interrupted here: SIGTERM lets it shut Ray down
                    child.proc.terminate()
                    child.proc.wait()
                raise
        return out
    children = [_Child(role, work, verbose, lockstep=True, env_extra=env_for.get(role)) for role in roles]
    try:
        for c in children:
            c.expect(b"R")
        print(f"[compare_trl] both sides are set up; alternating {steps} GRPO steps", flush=True)
        for j in range(steps):
            for c in (children if j % 2 == 0 else children[::-1]):
                c.go()
                c.expect(b"D")
            if (j + 1) % 10 == 0 or j + 1 == steps:
                print(f"[compare_trl] step {j + 1}/{steps} done on both sides "
                      f"(load average {os.getloadavg()[0]:.1f})", flush=True)
        for c in children:
            out[c.role] = c.wait()
    except BaseException:
        for c in children:
            if c.proc.poll() is None:
                c.stop()
        raise
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _sec(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.3f}"


def _table(rows: list[list[str]], header: list[str], numeric: bool = True) -> str:
    """Plain-text columns: the first left-aligned, the others right-aligned (``numeric``) or left."""
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 or not numeric else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def _settings_table(spec: dict, proj: dict | None, trl_res: dict | None) -> str:
    hp = spec["hp"]
    proj_nice = (proj or {}).get("worker_nice")
    per = hp["optimizer_steps_per_step"]
    s = hp["scheduler"]
    sched = (f"{s['decay']}: 1.0 -> {s['min_lr_ratio']}x over {s['total_steps']} opt. steps"
             + (f", warmup {s['warmup_steps']}" if s["warmup_steps"] else "") if s["decay"] != "constant"
             else "constant" + (f", warmup {s['warmup_steps']}" if s["warmup_steps"] else ""))
    trl_loss = _trl_loss_type(hp)
    adv = "(r - group mean) / (group std + 1e-6)"
    if hp["leave_one_out"]:
        adv = "leave-one-out: G/(G-1) x (r - group mean) / (group std + 1e-6)"
    if hp["std_scale"] != "group":
        adv = f"std_scale={hp['std_scale']}" + (", leave-one-out" if hp["leave_one_out"] else "")
    reuse = hp["reuse_generation_logprobs"]
    reuse_s = ("the sampler's (reused; recomputed every "
               f"{hp['logprob_check_period']} steps)" if reuse in (True, "auto") and hp["precision"] == "float32"
               else "recomputed by a forward pass")
    rows = [
        ["model", spec["model_path"], "same folder"],
        ["prompts per GRPO step", hp["num_prompts_per_step"], "same prompts, same order (shuffle_dataset=False)"],
        ["completions per prompt (G)", hp["num_generations"], f"num_generations={hp['num_generations']}"],
        ["completions per step", hp["completions_per_step"], f"generation_batch_size={hp['completions_per_step']}"],
        ["optimizer steps per GRPO step", f"{per} (train_global_batch_size={hp['train_global_batch_size']})",
         f"steps_per_generation={per}, per_device_train_batch_size={hp['train_global_batch_size']}, grad_accum=1"],
        ["micro-batch (rows per forward)", hp["train_micro_batch_size"], hp["train_global_batch_size"]],
        ["samples in each optimizer step", "contiguous whole groups", "random half of the generation (TRL shuffles)"],
        ["max new tokens", hp["max_new_tokens"], f"max_completion_length={hp['max_new_tokens']}"],
        ["prompt: max tokens / truncated", f"{hp['max_input_seq_length']} / {spec['prompts_truncated']}",
         "no limit / 0"],
        ["sampling", f"T={hp['temperature']}, top_p={hp['top_p']}, top_k={hp['top_k']}", "same"],
        ["stop at", f"eos id {spec['eos_token_id']} ({spec['eos_token']})",
         f"eos ids {trl_res['eos_token_ids']}" if trl_res else "-"],
        ["optimizer", f"AdamW lr={hp['lr']}, betas={tuple(hp['betas'])}, eps={hp['eps']}, wd={hp['weight_decay']}",
         f"same ({trl_res['optim'] if trl_res else 'AdamW'} passed via optimizers=)"],
        ["lr schedule", sched, "same function (LambdaLR of the project's lr_factor)"],
        ["max grad norm", hp["max_grad_norm"], hp["max_grad_norm"] or 0.0],
        ["KL to reference (beta)", hp["kl"], hp["kl"]],
        ["ratio clip", f"[1-{hp['clip_low']}, 1+{hp['clip_high']}]"
         + (f", dual clip c={hp['dual_clip_c']}" if hp["dual_clip_c"] else ""),
         f"epsilon={hp['clip_low']}, epsilon_high={hp['clip_high']}"],
        ["loss normalisation", "token mean over the global batch" if hp["token_level_loss"] else "per-sample mean",
         f"loss_type='{trl_loss}'" + (" (tokens of the generation / steps_per_generation)" if trl_loss == "dapo" else "")],
        ["advantage", adv, f"scale_rewards='{_trl_scale_rewards(hp)}': (r - group mean) / (group std + 1e-4)"],
        ["old-policy log-probs", reuse_s, "recomputed by a forward pass over the generation"],
        ["overlong filtering", hp["overlong_filtering"], f"mask_truncated_completions={hp['overlong_filtering']}"],
        ["precision", hp["precision"] + ("" if hp["precision"] == "float32" else " compute, float32 master weights"),
         "bf16=False, fp16=False" if hp["precision"] == "float32" else f"{hp['precision']} autocast (Accelerate)"],
        ["device", "GPU" if hp.get("gpus_per_worker") else "CPU",
         "GPU" if hp.get("gpus_per_worker") else "CPU (use_cpu=True)"],
        ["CPU threads (training)", f"{hp['num_workers']} worker(s) x {spec['threads'] // hp['num_workers']}",
         f"1 process x {trl_res['threads_in_training'] if trl_res else spec['threads']}"],
        ["CPU priority (nice) of the compute", f"{proj_nice} (Ray policy worker)" if proj_nice is not None else "-",
         f"{trl_res['nice']} (set to match)" if trl_res else "-"],
        ["reward", "math env actor (verify_math_answer rules)", "verify_math_answer as reward function"],
        ["seed", hp["seed"], hp["seed"]],
    ]
    if trl_res is not None:
        same = len(spec["train"]) - trl_res["prompt_ids_differ"]
        rows.append(["prompt token ids == project's", "-", f"{same}/{len(spec['train'])}"])
    return _table([[str(c) for c in r] for r in rows], ["setting", "project", f"TRL {TRL_PIN}"], numeric=False)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="compare_trl.py [options] [key=value overrides for the project config]")
    ap.add_argument("--steps", type=int, default=60, help="GRPO steps on each side (default 60)")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="project config (default: grpo_math_tiny.yaml)")
    ap.add_argument("--val-samples", type=int, default=None, help="held-out problems (default: the config's)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing (default 2)")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--skip-project", action="store_true")
    ap.add_argument("--json", default=None, help="also write every number to this JSON file")
    ap.add_argument("--keep", default=None, help="keep the work folder (logs, final models) here")
    ap.add_argument("--trl-nice", type=int, default=None,
                    help="niceness of the TRL process (default: Ray's worker niceness, which the project's "
                         "training worker runs at: $RAY_worker_niceness, else 15)")
    ap.add_argument("--sequential", action="store_true",
                    help="run one whole side after the other instead of alternating their steps")
    ap.add_argument("--verbose", action="store_true", help="show the children's output instead of logging it")
    for hidden in ("--_role", "--_work"):
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    for hidden in ("--_go", "--_done"):
        ap.add_argument(hidden, type=int, default=None, help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)

    if args._role:
        work, turns = Path(args._work), _Turns(args._go, args._done)
        if args._role == "project":
            role_project(work, turns)
        elif args._role == "trl":
            role_trl(work, turns)
        else:
            {"prepare": role_prepare, "eval": role_eval}[args._role](work)
        return 0

    bad = [a for a in rest if "=" not in a]
    if bad:
        ap.error(f"unexpected arguments {bad}: options are listed by --help, overrides are key=value")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.skip_trl and args.skip_project:
        ap.error("--skip-trl and --skip-project together leave nothing to run")
    trl_version = None
    if not args.skip_trl:
        trl_version = _trl_available()
        if trl_version is None:
            print("compare_trl: trl is not importable. TRL is a benchmark-only dependency; run this script as\n"
                  f"    {HOW_TO_RUN}\n(or pass --skip-trl to time the project alone)", file=sys.stderr)
            return 2
        if trl_version != TRL_PIN:
            print(f"[compare_trl] note: trl {trl_version} is installed; the script was written against {TRL_PIN}")

    # The schedule must span the benchmark run, validation is done by this script at start and end only,
    # and the run must neither resume nor leave checkpoints or logs in the repository.
    work = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="compare_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("spec.json", "project.json", "trl.json", "eval.json", "project_final", "trl_final", "trl_out"):
        if (work / stale).is_dir():  # a kept folder reused: nothing of an earlier run may be read back
            shutil.rmtree(work / stale)
        else:
            (work / stale).unlink(missing_ok=True)
    overrides = [f"grpo.max_num_steps={args.steps}", "grpo.val_period=0", "checkpointing.enabled=false",
                 f"checkpointing.checkpoint_dir={work / 'project_ckpt'}", f"logger.log_dir={work / 'project_logs'}",
                 "logger.stdout_enabled=false", "logger.tensorboard_enabled=false", "logger.wandb_enabled=false"]
    if args.val_samples is not None:
        overrides.append(f"grpo.max_val_samples={args.val_samples}")
    overrides += rest
    from nemo_like.config import ConfigError, load_config

    try:  # a bad key or value fails here in a second, before any child starts
        load_config(args.config, overrides)
    except ConfigError as e:
        print(f"compare_trl: {e}", file=sys.stderr)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        return 2
    _write(work / "request.json", {"config": str(Path(args.config).resolve()), "overrides": overrides,
                                    "user_overrides": rest, "steps": args.steps})
    # `kill` (SIGTERM) unwinds like Ctrl-C: the children are stopped and the work folder removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wall0 = time.perf_counter()
    durations: dict[str, float] = {}
    try:
        durations["prepare"] = _Child("prepare", work, args.verbose, lockstep=False).wait()
        spec = _read(work / "spec.json")
        threads = str(spec["threads"])
        one_process = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
        trl_nice = args.trl_nice if args.trl_nice is not None else int(os.environ.get("RAY_worker_niceness", "15"))
        roles = [r for r, skip in (("project", args.skip_project), ("trl", args.skip_trl)) if not skip]
        durations |= _run_sides(roles, work, args.steps, args.verbose, args.sequential,
                                {"trl": one_process | {"COMPARE_TRL_NICE": str(trl_nice)}})
        durations["eval"] = _Child("eval", work, args.verbose, lockstep=False, env_extra=one_process).wait()
        proj = _read(work / "project.json") if not args.skip_project else None
        trl_res = _read(work / "trl.json") if not args.skip_trl else None
        ev = _read(work / "eval.json")
        report = _report(args, spec, proj, trl_res, ev, durations, time.perf_counter() - wall0)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"\n[compare_trl] wrote {args.json}")
    return 0


def _report(args, spec, proj, trl_res, ev, durations, total_s) -> dict[str, Any]:
    from nemo_like.utils.stats import paired_change

    w, steps = args.warmup, spec["steps"]
    if w >= steps:
        print(f"[compare_trl] note: --warmup {w} >= --steps {steps}; timing over all steps instead")
        w = 0
    p_tot = _summary(proj["step_total"], w) if proj else None
    p_wall = _summary(proj["step_wall"], w) if proj else None
    t_wall = _summary(trl_res["step_wall"], w) if trl_res else None
    base = ev["base"]
    p_ev, t_ev = ev.get("project"), ev.get("trl")
    ratio = lambda a, b: "-" if not (a and b) else f"{a['mean'] / b['mean']:.2f}"
    ratio_med = lambda a, b: "-" if not (a and b) else f"{a['median'] / b['median']:.2f}"
    n_val = len(spec["val"])
    # Step j of one side ran right before or after step j of the other (when alternating), so the
    # ratio of the two sees nearly the same machine load: its median is the drift-proof comparison.
    paired_ratio = "-"
    if proj and trl_res:
        ratios = [a / b for a, b in zip(proj["step_total"][w:], trl_res["step_wall"][w:]) if b > 0]
        paired_ratio = f"{statistics.median(ratios):.2f}" if ratios else "-"
    timed = f"steps {w + 1}-{steps}" if w else f"all {steps} steps"

    user = spec["user_overrides"]
    print(f"\n=== settings (config {spec['config']}" + (f", overrides {' '.join(user)}" if user else "") + ") ===")
    print(_settings_table(spec, proj, trl_res))
    if proj and trl_res and proj.get("worker_nice") is not None and proj["worker_nice"] != trl_res["nice"]:
        print(f"note: the project's worker ran at nice {proj['worker_nice']} and TRL at {trl_res['nice']}: under "
              "load from other work the two got unequal CPU shares (--trl-nice sets TRL's)")

    def load(res: dict | None) -> str:
        xs = (res or {}).get("load_avg", [])[w:]
        return f"{statistics.mean(xs):.1f} (1-min)" if xs else "-"

    def last(xs: list[float], k: int = 5) -> str:
        xs = [x for x in xs if not math.isnan(x)][-k:]
        return f"{statistics.mean(xs):.3f}" if xs else "-"

    rows = [
        [f"s/GRPO step, mean ({timed})", _sec(p_tot and p_tot["mean"]), _sec(t_wall and t_wall["mean"]),
         ratio(p_tot, t_wall)],
        [f"s/GRPO step, median ({timed})", _sec(p_tot and p_tot["median"]), _sec(t_wall and t_wall["median"]),
         ratio_med(p_tot, t_wall)],
        ["median of per-step ratios (step j vs step j)", "", "", paired_ratio],
        ["s/GRPO step, min / max", f"{_sec(p_tot and p_tot['min'])} / {_sec(p_tot and p_tot['max'])}" if p_tot else "-",
         f"{_sec(t_wall['min'])} / {_sec(t_wall['max'])}" if t_wall else "-", ""],
        ["s/GRPO step, wall of step() (mean)", _sec(p_wall and p_wall["mean"]), _sec(t_wall and t_wall["mean"]),
         ratio(p_wall, t_wall)],
        ["first (warm-up) step, s", _sec(p_tot and p_tot["first"]), _sec(t_wall and t_wall["first"]), ""],
        [f"held-out greedy acc, step 0 (n={n_val})", _pct(base["accuracy"]) if proj else "-",
         _pct(base["accuracy"]) if trl_res else "-", ""],
        [f"held-out greedy acc, step {steps}", _pct(p_ev and p_ev["accuracy"]), _pct(t_ev and t_ev["accuracy"]),
         f"{(p_ev['accuracy'] - t_ev['accuracy']) * 100:+.1f} pts" if (p_ev and t_ev) else ""],
        ["  (project's own validate(), start -> end)",
         f"{_pct(proj['val_acc'][0])} -> {_pct(proj['val_acc'][1])}" if proj else "-", "", ""],
        ["train reward, step 1 / mean of last 5",
         f"{proj['reward_mean'][0]:.3f} / {last(proj['reward_mean'])}" if proj else "-",
         f"{trl_res['reward_mean'][0]:.3f} / {last(trl_res['reward_mean'])}" if trl_res and trl_res["reward_mean"] else "-",
         ""],
        ["load average during the timed steps", load(proj), load(trl_res), ""],
    ]
    mode = ("sequential: one side after the other" if args.sequential or not (proj and trl_res)
            else "alternating: the sides took turns, one GRPO step each")
    print(f"\n=== results: {steps} GRPO steps per side ({mode}); timing leaves out the first {w} (warm-up) ===")
    print(_table(rows, ["", "project", f"TRL {trl_res['trl_version'] if trl_res else TRL_PIN}", "project/TRL"]))
    print("\nproject s/step: its own timing/total (data, generation, reward, log-probs, update; logging and"
          "\nvalidation excluded). TRL s/step: wall time from the start of its turn to the on_step_end of the"
          f"\nGRPO step's last optimizer step (of {spec['hp']['optimizer_steps_per_step']}; generation, data"
          " loading and logging included).\nAccuracy: every model graded by the same evaluator here: HF greedy"
          f" generate, at most {spec['hp']['max_new_tokens']} new tokens,\nstop at {spec['eos_token']},"
          " verify_math_answer; paired results on the same problems (McNemar):")
    paired = {}
    if p_ev:
        paired["project: start -> end"] = paired_change(base["correct"], p_ev["correct"])
    if t_ev:
        paired["TRL: start -> end"] = paired_change(base["correct"], t_ev["correct"])
    if p_ev and t_ev:
        paired["TRL end -> project end"] = paired_change(t_ev["correct"], p_ev["correct"])
    if proj and p_ev:
        same = sum(a == b for a, b in zip(proj["val_correct"][1], p_ev["correct"]))
        paired["project end: own validate() vs this evaluator"] = f"{same}/{len(p_ev['correct'])} problems agree"
    for k, v in paired.items():
        print(f"  {k}: {v}")
    print(f"\ntotal wall time {total_s:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in durations.items()) + ")")
    return {"settings": {k: v for k, v in spec.items() if k not in ("train", "val")}, "warmup": w,
            "project": proj and {k: v for k, v in proj.items() if k != "val_correct"} | {
                "s_per_step_total": p_tot, "s_per_step_wall": p_wall},
            "trl": trl_res and trl_res | {"s_per_step_wall": t_wall},
            "eval": {k: {kk: vv for kk, vv in v.items() if kk != "correct"} for k, v in ev.items()},
            "paired": paired, "median_paired_step_ratio": paired_ratio, "durations_s": durations, "total_s": total_s}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
