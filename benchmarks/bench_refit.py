"""Refit time of the two weight transports, side by side: the object store against a gloo broadcast.

    uv run benchmarks/bench_refit.py [--repeats N] [--skip-smollm2] [--chunk-mb MB]

For each model (the multi-env default's tiny Llama, and a randomly initialised Llama of SmolLM2-135M's
shape, float32), one training worker (``Policy``) and two rollout groups of one worker each, one per
transport (``policy.generation.refit_transport``), refit in turns, ``--repeats`` times each. Prints the
median seconds of ``timing/weight_sync`` (export, move, load, all of it) and the bytes moved; checks
that every refit left the rollout worker with the policy's weights (checksums).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile


def build_models(root: str, skip_smollm2: bool) -> list[tuple[str, str]]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama

    out = []
    tiny = f"{root}/tiny"
    tok = build_char_tokenizer(tiny)
    build_tiny_llama(tok, hidden_size=128, num_layers=4, num_heads=4, max_position_embeddings=160, seed=0, save_dir=tiny)
    out.append(("tiny (multi-env default shape)", tiny))
    if not skip_smollm2:
        d = f"{root}/smollm2"
        tok = build_char_tokenizer(d)
        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                          rope_theta=100000.0, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id)
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).float().save_pretrained(d)
        out.append(("SmolLM2-135M shape", d))
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--chunk-mb", type=float, default=64.0)
    args = ap.parse_args(argv)

    from nemo_like.config_sections import GenerationClusterConfig
    from nemo_like.distributed.ray_cluster import RayVirtualCluster, init_ray
    from nemo_like.models.generation.rollout_group import RolloutGroup
    from nemo_like.models.policy import PolicyConfig
    from nemo_like.models.policy.lm_policy import Policy

    init_ray(num_cpus=4)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for label, path in build_models(root, args.skip_smollm2):
            base = dict(model_name=path, train_global_batch_size=2, train_micro_batch_size=2, logprob_batch_size=2,
                        generation_batch_size=2, max_total_sequence_length=64)
            cluster = RayVirtualCluster(1, cpus_per_worker=1, name="bench-refit")
            policy = Policy(cluster, PolicyConfig(**base), seed=0, init_reference_model=False, init_optimizer=False,
                            name_prefix="bench-refit")
            groups = {t: RolloutGroup(PolicyConfig(**base, generation={"colocated": False, "refit_transport": t,
                                                                      "refit_chunk_mb": args.chunk_mb}),
                                      GenerationClusterConfig(num_workers=1, cpus_per_worker=1), name_prefix=f"bench-{t}")
                      for t in ("object_store", "collective")}
            try:
                want = policy.weights_checksum()
                times: dict[str, list[float]] = {t: [] for t in groups}
                moved: dict[str, float] = {}
                for v in range(1, args.repeats + 2):  # the first refit of each (setting up) is not timed
                    for t, g in groups.items():
                        m = g.update_weights_from(policy, version=v)
                        if g.weights_checksums() != [want]:
                            raise RuntimeError(f"{t}: the rollout worker's weights differ from the policy's")
                        if v > 1:
                            times[t].append(m["timing/weight_sync"])
                        moved[t] = m["refit/bytes"]
                for t in groups:
                    rows.append((label, t, statistics.median(times[t]), moved[t] / 2**20))
            finally:
                for g in groups.values():
                    g.shutdown()
                policy.shutdown()
                cluster.shutdown()
    print(f"\nrefit (export, move, load), median of {args.repeats}, chunks/buckets of {args.chunk_mb:g} MiB:\n")
    print("| model | transport | seconds | MiB moved | MiB/s |")
    print("|---|---|---:|---:|---:|")
    for label, t, s, mib in rows:
        print(f"| {label} | {t} | {s:.3f} | {mib:.1f} | {mib / s:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
