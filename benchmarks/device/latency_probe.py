"""Where a small model's GPU time goes on the lent machine: the cost of one kernel launch, of one
decode forward of the SmolLM2-135M shape at several batch sizes, of HF ``generate``, and of plain
Python on its CPU. Needs torch and transformers only (no Ray, nothing of this project), so it runs
in one device call on a bare machine:

    python3 benchmarks/device/latency_probe.py [--device cuda] [--json PATH]

Why: on the first acceptance run (2026-11-27) SmolLM2's GRPO steps took seconds on an H100 and the
batch-256 generation benchmark did not finish in 80 s, which a launch- or CPU-bound loop would explain.
A stack of every thread is printed if the probe is still running after --hang-s seconds.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0, tie_word_embeddings=True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int = 3) -> float:
    """Best wall seconds of ``reps`` calls (after one warm-up)."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--hang-s", type=float, default=100)
    ap.add_argument("--layers", type=int, default=SMOLLM2["num_hidden_layers"])
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.hang_s, exit=False)
    dev = args.device
    out: dict = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__}

    def put(key, value):
        out[key] = value
        print(f"{key:40s} {value}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    t = time.perf_counter()
    s = 0
    for i in range(3_000_000):
        s += i
    put("python_loop_3M_s", round(time.perf_counter() - t, 4))

    x = torch.zeros(16, device=dev)
    n = 2000

    def launches():
        for _ in range(n):
            x.add_(1)

    put("kernel_launch_us", round(timed(launches, dev) / n * 1e6, 2))

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**SMOLLM2, "num_hidden_layers": args.layers})
    model = LlamaForCausalLM(cfg).to(device=dev, dtype=torch.bfloat16).eval()
    put("layers", args.layers)
    for batch in (1, 64, 256):
        ids = torch.randint(0, cfg.vocab_size, (batch, 48), device=dev)
        with torch.no_grad():
            prefill = model(ids, use_cache=True)
            past = prefill.past_key_values
            step_ids = ids[:, -1:]

            def decode(step_ids=step_ids, past=past):
                # The cache grows by one token a call (48 -> 59 over the 11 calls): about the same work.
                model(step_ids, past_key_values=past, use_cache=True)

            put(f"decode_forward_ms_b{batch}", round(timed(decode, dev, reps=10) * 1e3, 2))
    for batch, new in ((64, 32), (256, 32)):
        ids = torch.randint(0, cfg.vocab_size, (batch, 48), device=dev)
        attn = torch.ones_like(ids)

        def gen(ids=ids, attn=attn, new=new):
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=new, min_new_tokens=new,
                               do_sample=True, temperature=1.0, top_k=0, pad_token_id=0)

        secs = timed(gen, dev, reps=1)
        put(f"hf_generate_b{batch}_x{new}_s", round(secs, 3))
        put(f"hf_generate_b{batch}_tokens_per_s", round(batch * new / secs, 1))
    faulthandler.cancel_dump_traceback_later()
    put("ok", True)


if __name__ == "__main__":
    sys.exit(main())
