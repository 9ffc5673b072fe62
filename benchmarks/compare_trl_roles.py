"""The four roles of benchmarks/compare_trl.py, each run in its own subprocess by it:

    prepare   the model folder and the rendered prompts, in the project's sampler order
    project   this project's GRPOExperiment, one GRPO step per turn
    trl       TRL's GRPOTrainer on the same settings, one GRPO step per turn
    eval      one evaluator for the base model and both final models

    python benchmarks/compare_trl_roles.py --_role ROLE --_work DIR [--_go FD --_done FD]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRL_PIN = "1.16.0"


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
        info = d["extra_env_info"]
        out.append({"idx": int(i), "text": "".join(m["content"] for m in log), "ids": ids,
                    "ground_truth": str(info["ground_truth"]), "truncated": float(d["loss_multiplier"]) == 0.0,
                    **{k: info[k] for k in _RG_KEYS if k in info}})
    return out


_RG_KEYS = ("rg_dataset", "rg_options", "rg_index")


def _grader(cfg) -> dict[str, Any]:
    """How both sides grade: the math verifier, or reasoning-gym's scorer as the environment reads it."""
    envs = {c.env_name for c in cfg.data.train_list + cfg.data.validation_list}
    if envs == {"reasoning_gym"}:
        from nemo_like.environments.reasoning_gym_environment import ReasoningGymEnvConfig

        opts = ReasoningGymEnvConfig(**cfg.env.get("reasoning_gym", {}))
        return {"kind": "reasoning_gym", "answer_format": opts.answer_format, "answer_tag": opts.answer_tag,
                "partial_credit": opts.partial_credit}
    return {"kind": "math"}


def trl_micro_batches(hp: dict) -> tuple[int, int]:
    """TRL's (per_device_train_batch_size, gradient_accumulation_steps): the config's micro-batch size
    when it divides the global batch, else the whole global batch in one pass."""
    gbs, mbs = hp["train_global_batch_size"], hp["train_micro_batch_size"]
    return (mbs, gbs // mbs) if gbs % mbs == 0 else (gbs, 1)


def grade(grader: dict[str, Any], text: str, row: dict[str, Any]) -> float:
    """The reward of a completion ``text`` for a prompt ``row``, as the project's environment gives it."""
    if grader["kind"] == "math":
        from nemo_like.environments.math_environment import verify_math_answer

        return verify_math_answer(text, row["ground_truth"])
    from nemo_like.data.reasoning_gym_tasks import score_reasoning_gym_answer
    from nemo_like.environments.reasoning_gym_environment import extract_answer

    answer = extract_answer(text, grader["answer_format"], grader["answer_tag"])
    if answer is None:
        return 0.0
    score = min(1.0, max(0.0, float(score_reasoning_gym_answer(row["rg_dataset"], row["rg_options"],
                                                               row["rg_index"], answer))))
    return score if grader["partial_credit"] or score >= 1.0 else 0.0


def role_prepare(work: Path) -> None:
    from transformers import AutoTokenizer

    from nemo_like.algorithms.grpo_setup import build_task_dataset, make_train_sampler
    from nemo_like.data.datasets import load_dataset_from_config

    req = _read(work / "request.json")
    cfg = _load_cfg(req)
    g, p, lf = cfg.grpo, cfg.policy, cfg.loss_fn
    problems = []
    for c in cfg.data.train_list + cfg.data.validation_list:
        if c.env_name not in ("math", "reasoning_gym") or c.reward_fns:
            problems.append(f"task {c.task_name!r} is graded by {c.env_name!r}"
                            f"{' with reward_fns' if c.reward_fns else ''}, not the math verifier or reasoning-gym's scorer")
    if len({c.env_name for c in cfg.data.train_list + cfg.data.validation_list}) > 1:
        problems.append("the tasks are graded by more than one environment; this benchmark grades with one")
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
        "model_path": model_path, "tokenizer_path": tok_path, "grader": _grader(cfg),
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
    # TRL hands a reward function the dataset's columns: the row's index finds what grades it.
    dataset = Dataset.from_dict({"prompt": texts, "row": list(range(len(rows)))})
    grader = spec["grader"]

    def math_accuracy(completions, row, **_: Any) -> list[float]:
        return [grade(grader, c, rows[j]) for c, j in zip(completions, row)]

    per_step = hp["optimizer_steps_per_step"]
    micro, accum = trl_micro_batches(hp)
    # TRL turns activation ("gradient") checkpointing on by default; the project's default is off.
    # Newer transformers name it activation_checkpointing (the old name still works, with a warning).
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    ckpt_off = {"activation_checkpointing": False} if "activation_checkpointing" in names else {
        "gradient_checkpointing": False}
    args = GRPOConfig(
        output_dir=str(work / "trl_out"),
        # batching: one generation of prompts x G completions, `per_step` optimizer steps over it
        # The config's micro-batches (a whole global batch in one forward pass does not fit in memory
        # with a real vocabulary: SmolLM2's 64 x 115 x 49,152 float32 logits are 1.4 GB per copy).
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        steps_per_generation=per_step * accum,
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
            correct.append(grade(spec["grader"], text, r) >= 1.0)
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


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="one role of compare_trl.py")
    ap.add_argument("--_role", required=True, choices=["prepare", "project", "trl", "eval"])
    ap.add_argument("--_work", required=True)
    ap.add_argument("--_go", type=int, default=None)
    ap.add_argument("--_done", type=int, default=None)
    args = ap.parse_args(argv)
    work, turns = Path(args._work), _Turns(args._go, args._done)
    if args._role == "project":
        role_project(work, turns)
    elif args._role == "trl":
        role_trl(work, turns)
    else:
        {"prepare": role_prepare, "eval": role_eval}[args._role](work)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
