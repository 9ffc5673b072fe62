"""This project's DPO against TRL's DPOTrainer on identical pairs: seconds per step, side by side.

    uv run --with trl==1.16.0 benchmarks/compare_trl_dpo.py [--steps 30] [--warmup 3] [--json PATH]
        [--config examples/configs/dpo_math_tiny.yaml] [--trl-precompute-ref] [key=value ...]

Both sides read one DPO config (default: the tiny math one, plus key=value overrides): the same base
model and tokenizer, the same pairs in the same batches (this project's epoch shuffle; TRL's sampler is
made sequential over the pairs in that order), the same pairs per step, per-side token limit
(``data.max_length``; TRL's ``max_length``), beta, loss type, learning rate, AdamW settings, gradient
clipping and constant schedule, float32 on the CPU, plain DPO (``dpo.sft_weight=0``). The project's side is its DPO step on its policy
workers (``dpo.dpo_step``: a log-prob pass and a training pass, packing as the config says); TRL's
is ``DPOTrainer`` as shipped (its reference model's forward each step unless
``--trl-precompute-ref``; the project precomputes its reference once, timed apart as set-up).

The two take turns in one process, one step each: TRL's callback at the end of each of its steps runs
one project step, so load from other work on the machine falls on both alike. TRL's step time runs
from the end of the previous project step to the end of its own step (data loading and logging
included); the project's is its ``timing/step``. The first ``--warmup`` steps are left out. TRL
comes in only through ``uv run --with``: it is no dependency of the project.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "examples" / "configs" / "dpo_math_tiny.yaml"
TRL_PIN = "1.16.0"


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None, help="write the table and settings here")
    p.add_argument("--trl-precompute-ref", action="store_true", help="TRL precomputes its reference log-probs too")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the DPO config")
    return p.parse_args(argv)


def _summary(xs: list[float]) -> dict[str, float]:
    return {"mean_s": statistics.fmean(xs), "median_s": statistics.median(xs), "steps": len(xs)}


def main(argv: list[str]) -> int:
    a = _args(argv)
    try:
        import trl
        from trl import DPOConfig as TRLConfig
        from trl import DPOTrainer
    except ImportError:
        print(f"compare_trl_dpo: TRL is not installed; run: uv run --with trl=={TRL_PIN} "
              "benchmarks/compare_trl_dpo.py", file=sys.stderr)
        return 2
    import datasets
    import torch
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from nemo_like.algorithms.dpo import (
        _rows,
        _seq_logprobs,
        attention_ratio,
        dpo_step,
        load_dpo_config,
        tokenize_dpo_pairs,
    )
    from nemo_like.algorithms.rm import load_pairs, resolve_model
    from nemo_like.algorithms.trainer_base import epoch_batches
    from nemo_like.distributed.ray_cluster import RayVirtualCluster, init_ray, shutdown_ray_if_started
    from nemo_like.models.policy.lm_policy import Policy

    # Plain DPO on both sides: TRL's SFT term normalises over the batch's tokens, not per sequence.
    cfg = load_dpo_config(a.config, ["dpo.sft_weight=0", *a.overrides])
    if cfg.dpo.sft_weight:
        raise SystemExit("compare_trl_dpo: compares plain DPO; leave dpo.sft_weight at 0")
    P = cfg.policy.train_global_batch_size // 2
    train_pairs, _ = load_pairs(cfg.data)
    batches = epoch_batches(len(train_pairs), P, cfg.trainer.num_epochs, cfg.trainer.seed)[:a.steps]
    if len(batches) < a.steps:
        raise SystemExit(f"only {len(batches)} steps of {P} pairs in the data; raise data.math_pairs.num_train")
    order = [i for _, idx in batches for i in idx]
    started = init_ray(address=cfg.cluster.address, num_cpus=cfg.cluster.num_cpus)
    policy = cluster = None
    try:
        model_dir = resolve_model(cfg.policy.model_name, key="policy.model_name")
        tok = AutoTokenizer.from_pretrained(model_dir)
        train = tokenize_dpo_pairs(train_pairs, tok, cfg.data.max_length)
        cluster = RayVirtualCluster(cfg.cluster.num_workers, cpus_per_worker=cfg.cluster.cpus_per_worker,
                                    name="dpo_bench")
        policy = Policy(cluster, cfg.policy.model_copy(update={"model_name": model_dir}), seed=cfg.trainer.seed,
                        init_reference_model=False)
        t = time.perf_counter()
        ref = _seq_logprobs(policy, _rows(train))
        ours_setup = time.perf_counter() - t
        n_tokens, ratio = train["token_mask"].sum(1), attention_ratio(model_dir)

        torch.set_num_threads(int(cfg.cluster.cpus_per_worker * cfg.cluster.num_workers))  # the cores ours has
        msgs = [{"prompt": [{"role": r, "content": c} for r, c in train_pairs[i].prompt],
                 "chosen": [{"role": r, "content": c} for r, c in train_pairs[i].chosen],
                 "rejected": [{"role": r, "content": c} for r, c in train_pairs[i].rejected]} for i in order]
        o = cfg.policy.optimizer
        out_dir = tempfile.mkdtemp(prefix="trl_dpo_")
        targs = TRLConfig(output_dir=out_dir, per_device_train_batch_size=P, gradient_accumulation_steps=1,
                          learning_rate=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
                          adam_epsilon=o.eps, max_grad_norm=cfg.policy.max_grad_norm or 0.0,
                          lr_scheduler_type="constant", warmup_steps=0, max_steps=a.steps, beta=cfg.dpo.beta,
                          loss_type=[cfg.dpo.loss_type], label_smoothing=cfg.dpo.label_smoothing,
                          max_length=cfg.data.max_length, precompute_ref_log_probs=a.trl_precompute_ref,
                          logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
                          dataloader_num_workers=0, seed=cfg.trainer.seed, disable_tqdm=True,
                          # TRL turns it on by default; the project trains without it (policy.activation_checkpointing).
                          gradient_checkpointing=cfg.policy.activation_checkpointing)
        times: dict[str, list[float]] = {"trl": [], "ours": []}
        losses: dict[str, list[float]] = {"trl": [], "ours": []}
        mark, one_pass = [0.0], []
        step_iter = iter(batches)

        class Lockstep(TrainerCallback):
            def on_train_begin(self, *args: Any, **kw: Any) -> None:
                mark[0] = time.perf_counter()

            def on_step_end(self, *args: Any, **kw: Any) -> None:
                times["trl"].append(time.perf_counter() - mark[0])
                _, idx = next(step_iter)
                m = dpo_step(policy, train, ref, n_tokens, idx, cfg.dpo, ratio)
                times["ours"].append(m["timing/step"])
                one_pass.append(m["train/one_pass"])
                losses["ours"].append(m["train/loss"])
                mark[0] = time.perf_counter()

            def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
                if logs and "loss" in logs:
                    losses["trl"].append(float(logs["loss"]))

        class InOrder(DPOTrainer):
            def _get_train_sampler(self, *args: Any, **kw: Any) -> Any:  # the project's batches, in its order
                return SequentialSampler(self.train_dataset)

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        t = time.perf_counter()
        trainer = InOrder(model=model, args=targs, train_dataset=datasets.Dataset.from_list(msgs),
                          processing_class=tok, callbacks=[Lockstep()])
        trl_setup = time.perf_counter() - t
        trainer.train()
    finally:
        if policy is not None:
            policy.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutdown_ray_if_started(started)

    w = a.warmup
    res = {side: _summary(times[side][w:]) | {"first_loss": losses[side][0], "last_loss": losses[side][-1]}
           for side in ("trl", "ours")}
    res["trl"]["setup_s"], res["ours"]["setup_s"] = trl_setup, ours_setup
    res["ours"]["one_pass_share"] = sum(one_pass) / len(one_pass)
    ratio = res["ours"]["mean_s"] / res["trl"]["mean_s"]
    settings = {"config": a.config, "overrides": a.overrides, "trl": trl.__version__, "pairs_per_step": P,
                "max_length": cfg.data.max_length, "beta": cfg.dpo.beta, "loss_type": cfg.dpo.loss_type,
                "lr": o.lr, "steps": a.steps, "warmup": w, "trl_precompute_ref": a.trl_precompute_ref,
                "packing": cfg.policy.sequence_packing.enabled, "cpus": cfg.cluster.cpus_per_worker,
                "activation_checkpointing": cfg.policy.activation_checkpointing}
    print(f"\nDPO, {P} pairs a step, {cfg.data.max_length} tokens a side, {a.steps} steps ({w} warm-up left out), "
          f"TRL {trl.__version__} (reference {'precomputed' if a.trl_precompute_ref else 'forward each step'})")
    print(f"{'side':<8}{'mean s/step':>12}{'median':>9}{'set-up s':>10}{'loss 1st':>10}{'loss last':>10}")
    for side, name in (("trl", "TRL"), ("ours", "nemo_like")):
        r = res[side]
        print(f"{name:<8}{r['mean_s']:>12.3f}{r['median_s']:>9.3f}{r['setup_s']:>10.1f}{r['first_loss']:>10.4f}"
              f"{r['last_loss']:>10.4f}")
    print(f"ratio (nemo_like / TRL seconds per step): {ratio:.2f}x (target <= 0.5x); nemo_like trained "
          f"{res['ours']['one_pass_share']:.0%} of its steps in one pass (dpo.one_pass)")
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": settings, "results": res, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
