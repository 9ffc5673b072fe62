"""The embedded default base model: a tiny char-level Llama that has been taught, by a short
supervised run, to answer arithmetic as `\\boxed{N}` — right often enough that GRPO has signal,
wrong often enough that it has something to fix. Built once per config and cached on disk."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

from nemo_like.config import MasterConfig
from nemo_like.data.errors import DataError

# Bump when the recipe below changes so stale caches are not reused.
_RECIPE_VERSION = 1


# Dataset settings the SFT never reads: changing them must not rebuild the base model.
_NOT_SFT = {"sampling_weight"}


def bootstrap_cache_path(cfg: MasterConfig) -> Path:
    b = cfg.bootstrap
    assert b is not None
    data_cfgs = [b.data] if b.data else cfg.data.train_list
    # extra_tokens joins the key only when used, so existing caches of plain models stay valid.
    model = b.model.model_dump(exclude=set() if b.model.extra_tokens else {"extra_tokens"})
    key = json.dumps({"v": _RECIPE_VERSION, "model": model, "sft": _sft_key(b.sft),
                      "seed": b.seed, "data": [d.model_dump(exclude=_NOT_SFT | (set() if d.reward_fns else {"reward_fns"})) for d in data_cfgs],
                      "max_in": cfg.data.max_input_seq_length, "max_len": cfg.policy.max_total_sequence_length,
                      "workers": b.num_workers or cfg.cluster.num_workers, **_generated_data_version(data_cfgs)},
                     sort_keys=True)
    return Path(b.cache_dir).expanduser() / f"tiny-math-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


# SFT settings added after caches existed: left out of the key while at their default, so those
# caches stay valid.
_LATE_SFT_DEFAULTS = {"group_by_length": False, "lr_decay": "constant", "stop_at_val_loss": None,
                      "holdout_rows": 256, "val_every": 25}


def _sft_key(sft: Any) -> dict:
    return {k: v for k, v in sft.model_dump().items() if k not in _LATE_SFT_DEFAULTS or v != _LATE_SFT_DEFAULTS[k]}


def _generated_data_version(data_cfgs: list) -> dict[str, str]:
    """Generated tool tasks also depend on the tool table, which lives in code: it joins the key
    (only for configs that use it, so other caches stay valid)."""
    if not any(getattr(d.generator, "kind", None) == "tool" for d in data_cfgs):
        return {}
    from nemo_like.environments.tools import LOOKUP_TABLE

    table = json.dumps(sorted(LOOKUP_TABLE.items()))
    return {"tool_table": hashlib.sha256(table.encode()).hexdigest()[:12]}


def ensure_base_model(cfg: MasterConfig) -> str:
    """Return the folder of the bootstrapped base model, building it if it is not cached.

    Building takes a placement group of its own (``bootstrap.num_workers`` workers sharing the
    cluster's CPUs) and gives it back, so call this before the policy's cluster is reserved."""
    out = bootstrap_cache_path(cfg)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return str(out)
    from nemo_like.distributed.ray_cluster import RayVirtualCluster

    b = cfg.bootstrap
    assert b is not None
    workers = b.num_workers or cfg.cluster.num_workers
    cluster = RayVirtualCluster(workers, cpus_per_worker=cfg.cluster.num_workers * cfg.cluster.cpus_per_worker / workers,
                                gpus_per_worker=cfg.cluster.gpus_per_worker, name="bootstrap")
    try:
        return _build_base_model(cfg, cluster, out)
    finally:
        cluster.shutdown()


def _split_holdout(dataset: Any, s: Any, seed: int, pad_id: int) -> tuple[Any, Any]:
    """(training rows, held-out batch or None): with ``stop_at_val_loss``, ``holdout_rows`` rows drawn
    with the seed are kept out of training for the held-out loss."""
    from torch.utils.data import Subset

    from nemo_like.algorithms.sft_loop import sft_batch

    if s.stop_at_val_loss is None:
        return dataset, None
    if s.holdout_rows >= len(dataset):
        raise DataError(f"bootstrap.sft.holdout_rows={s.holdout_rows} leaves nothing to train on: the "
                        f"bootstrap's data has {len(dataset)} rows")
    order = list(range(len(dataset)))
    random.Random(seed).shuffle(order)
    kept = sorted(order[:s.holdout_rows])
    return Subset(dataset, sorted(order[s.holdout_rows:])), sft_batch([dataset[i] for i in kept], pad_id)


def _report_stop(history: list[dict], s: Any, out: Path) -> None:
    """Says where the run stopped and keeps it with the model (``bootstrap.json``)."""
    checks = [h for h in history if "val/loss" in h]
    if not checks:  # num_steps 0: nothing trained, nothing checked
        return
    last = checks[-1]
    reached = last["val/loss"] <= s.stop_at_val_loss
    info = {"steps": last["step"], "val_loss": last["val/loss"], "stop_at_val_loss": s.stop_at_val_loss,
            "reached": reached, "val_losses": {int(h["step"]): round(h["val/loss"], 4) for h in checks}}
    (out / "bootstrap.json").write_text(json.dumps(info, indent=1) + "\n")
    if reached:
        print(f"[nemo_like] bootstrap SFT stopped at step {last['step']}: held-out loss {last['val/loss']:.4f} "
              f"<= bootstrap.sft.stop_at_val_loss={s.stop_at_val_loss}")
    else:
        print(f"[nemo_like] bootstrap SFT ran its {last['step']} steps (bootstrap.sft.num_steps) without the held-out "
              f"loss reaching bootstrap.sft.stop_at_val_loss={s.stop_at_val_loss}: {last['val/loss']:.4f}")


def _build_base_model(cfg: MasterConfig, cluster: Any, out: Path) -> str:
    from nemo_like.algorithms.sft_loop import sft_train
    from nemo_like.data.datasets import load_dataset_from_config
    from nemo_like.models.policy.interfaces import (
        DynamicBatchingConfig,
        LoraConfig,
        SchedulerConfig,
        SequencePackingConfig,
    )
    from nemo_like.models.policy.lm_policy import Policy
    from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama

    b = cfg.bootstrap
    assert b is not None
    print(f"[nemo_like] building the tiny base model (once) into {out}")
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = build_char_tokenizer(tmp, extra_tokens=b.model.extra_tokens)
    build_tiny_llama(tok, hidden_size=b.model.hidden_size, num_layers=b.model.num_layers,
                     num_heads=b.model.num_heads, intermediate_size=b.model.intermediate_size,
                     max_position_embeddings=b.model.max_position_embeddings, seed=b.seed, save_dir=tmp)

    from nemo_like.algorithms.grpo_setup import build_task_dataset

    data_cfgs = [b.data] if b.data else cfg.data.train_list
    dataset = build_task_dataset(data_cfgs, [load_dataset_from_config(d) for d in data_cfgs], tok,
                                 cfg.policy.max_total_sequence_length, sft=True)

    s = b.sft
    policy_cfg = cfg.policy.model_copy(update={
        "model_name": str(tmp), "tokenizer_name": str(tmp), "train_global_batch_size": s.batch_size,
        "train_micro_batch_size": min(s.micro_batch_size, s.batch_size),
        "optimizer": cfg.policy.optimizer.model_copy(update={"lr": s.lr}),
        # The base model is built by the recipe its cache key names: the GRPO run's packing, token
        # budgets or batch balancing (same update, other rounding) must not change it.
        "sequence_packing": SequencePackingConfig(), "dynamic_batching": DynamicBatchingConfig(),
        "balance_batch": False,
        # The base model is trained whole from random weights; a GRPO run's LoRA adapts it afterwards.
        "lora": LoraConfig(),
        "scheduler": SchedulerConfig(warmup_steps=s.warmup_steps, decay=s.lr_decay if s.num_steps > s.warmup_steps else "constant",
                                     total_steps=s.num_steps or None)})
    train, holdout = _split_holdout(dataset, s, b.seed, tok.pad_token_id)
    policy = Policy(cluster, policy_cfg, seed=b.seed, init_reference_model=False, name_prefix="sft")
    try:
        history = sft_train(policy, train, num_steps=s.num_steps, batch_size=s.batch_size,
                            micro_batch_size=policy_cfg.train_micro_batch_size, pad_id=tok.pad_token_id, seed=b.seed,
                            desc="bootstrap SFT", group_by_length=s.group_by_length, holdout=holdout,
                            stop_at_val_loss=s.stop_at_val_loss, val_every=s.val_every)
        policy.save_checkpoint(str(tmp))
    finally:
        policy.shutdown()
    if holdout is not None:
        _report_stop(history, s, tmp)
    # Optimizer and RNG state belong to the SFT run, not to the base model.
    for f in list(tmp.glob("optimizer.pt")) + list(tmp.glob("rng_rank*.pt")):
        f.unlink()
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished first; its model is equivalent (same seed and recipe)
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
