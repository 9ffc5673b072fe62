"""Export a checkpoint as a plain HF model folder: `uv run examples/export_model.py --checkpoint DIR --out DIR`

``--checkpoint`` is a GRPO checkpoint (``<checkpoint_dir>/step_N``: verified against its manifest
first, the policy settings read from its run_config.json) or a folder written by
``Policy.save_checkpoint`` (a LoRA one names its base model in lora.json). The checkpoint is loaded
into a one-worker Policy exactly as a resumed run would load it, and ``Policy.export_merged`` writes
the model: with ``policy.lora`` the adapter merged into the base weights. The result (float32, the
training weights' precision, with the checkpoint's tokenizer) loads with
``AutoModelForCausalLM.from_pretrained(out)`` and needs neither peft nor this project.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nemo_like.models.policy.interfaces import (
    DynamicBatchingConfig,
    PolicyConfig,
    SequencePackingConfig,
)


def policy_for_checkpoint(checkpoint: Path) -> tuple[PolicyConfig, Path]:
    """The policy settings a checkpoint was written with, and the folder that holds its weights."""
    from nemo_like.models.policy.lora import LORA_INFO
    from nemo_like.utils.checkpoint import verify_checkpoint

    if (checkpoint / "run_config.json").exists():  # a GRPO step_N
        verify_checkpoint(checkpoint)
        cfg = PolicyConfig.model_validate(json.loads((checkpoint / "run_config.json").read_text())["policy"])
        weights = checkpoint / "policy"
    elif (checkpoint / LORA_INFO).exists():
        info = json.loads((checkpoint / LORA_INFO).read_text())
        cfg, weights = PolicyConfig(model_name=info["model_name"], lora=info["lora"]), checkpoint
    elif (checkpoint / "config.json").exists():  # full weights: already an HF folder, re-written without the rest
        cfg, weights = PolicyConfig(model_name=str(checkpoint)), checkpoint
    else:
        raise ValueError(f"{checkpoint} is not a checkpoint: no run_config.json (a GRPO step_N), {LORA_INFO} "
                         "(a LoRA policy folder) or config.json (a full-weight policy folder)")
    # Only the weights matter here: the checkpoint's tokenizer, one unsharded fp32 worker, no
    # packing probe or activation checkpointing.
    return cfg.model_copy(update={
        "tokenizer_name": str(weights), "fsdp": False, "activation_checkpointing": False, "num_threads": None,
        "sequence_packing": SequencePackingConfig(), "dynamic_batching": DynamicBatchingConfig()}), weights


def export(checkpoint: str | Path, out: str | Path) -> Path:
    from nemo_like.distributed.ray_cluster import RayVirtualCluster, init_ray, shutdown_ray_if_started
    from nemo_like.models.policy.lm_policy import Policy

    cfg, weights = policy_for_checkpoint(Path(checkpoint))
    started = init_ray(num_cpus=1)
    try:
        cluster = RayVirtualCluster(1, cpus_per_worker=1, name="export")
        try:
            policy = Policy(cluster, cfg, init_reference_model=False, init_optimizer=False, name_prefix="export",
                            weights_path=str(weights))
            try:
                policy.export_merged(str(out))
            finally:
                policy.shutdown()
        finally:
            cluster.shutdown()
    finally:
        shutdown_ray_if_started(started)
    return Path(out)


def main(argv: list[str]) -> int:
    from nemo_like.utils.checkpoint import CheckpointError

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a GRPO step_N folder or a Policy.save_checkpoint folder")
    ap.add_argument("--out", required=True, help="the HF folder to write")
    args = ap.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out)
    except (ValueError, CheckpointError, RuntimeError) as e:  # RuntimeError: a worker refused the checkpoint
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[nemo_like] merged model written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
