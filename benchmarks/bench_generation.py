"""Rollout throughput (generated tokens per second) of the generation engines, on CPU or a GPU.

    uv run benchmarks/bench_generation.py [--quick] [--reps N] [--threads N] [--skip-compile]
    python benchmarks/bench_generation.py --device cuda     # the GPU target: SmolLM2-135M shape, batch 256

Engines: HF `generate` per micro-batch (`policy.generation.engine=generate`), this project's continuous
batching (`engine=continuous`; `continuous:static`, `:compiled`, `:graphs`: its fixed-shape decode steps,
`policy.generation.decode_mode`), transformers' own continuous batching (`model.generate_batch`, on a
capped subset: it is slow on CPU) and `generate` with a static cache and `torch.compile`. Models are
randomly initialised (no download): the multi-env default's tiny char-level Llama and a Llama with
SmolLM2-135M's shape. Workloads are GRPO-like (each prompt repeated G times, sampling at T=1.0):
"full" (every sample may use max_new_tokens; random models almost never emit EOS, so every sample
does) and "ragged" (max_total_sequence_length leaves each sample its own budget, as in multi-turn
rollouts: longer prompts get fewer tokens). tokens/s = tokens the samples keep (sum of
generation_lengths) / wall seconds, best of --reps runs, engines interleaved. "greedy" says whether the
engine's greedy tokens equal `generate`'s on the first samples of the workload.

``--device cuda`` runs the GPU workload instead: the SmolLM2-135M-shaped model in bfloat16, 64 prompts
x G=4 = 256 samples decoded together (``--gpu-new-tokens`` each, slots 256), the issue's target being
the continuous engine at >= 5x `generate`'s tokens/s there.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.generation.hf_generation import hf_generate
from nemo_like.models.generation.interfaces import GenerationConfig
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama

DEVICE = torch.device("cpu")  # --device sets it
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


@dataclass
class Work:
    name: str
    data: BatchedDataDict
    max_new: int
    max_total: int
    micro_batch: int


def grpo_prompts(vocab_lo: int, vocab_hi: int, n_prompts: int, G: int, pad_id: int, seed: int) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, 61, (n_prompts,), generator=g)
    ids = torch.full((n_prompts, int(lens.max())), pad_id)
    for i, n in enumerate(lens.tolist()):
        ids[i, :n] = torch.randint(vocab_lo, vocab_hi, (n,), generator=g)
    return BatchedDataDict(input_ids=ids, input_lengths=lens).repeat_interleave(G)


def smollm2_shaped(vocab: int, pad_id: int, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      rope_theta=100000.0, tie_word_embeddings=True, pad_token_id=pad_id, eos_token_id=eos_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).float().eval()


class Timeout(Exception):
    pass


def _alarm(seconds: int):
    def handler(signum, frame):
        raise Timeout(f"over {seconds} s")

    signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)


def run_engine(engine: str, model, tok, w: Work, greedy: bool, data: BatchedDataDict | None = None,
               cb_cap: int = 0) -> tuple[int, float, torch.Tensor]:
    """(generated tokens kept, seconds, output ids)."""
    data = data if data is not None else w.data
    if engine == "generate_batch":
        from transformers import GenerationConfig as HFGen

        n = data["input_lengths"]
        take = min(cb_cap, len(n)) if cb_cap else len(n)
        inputs = [data["input_ids"][i, : int(n[i])].tolist() for i in range(take)]
        gcfg = HFGen(max_new_tokens=w.max_new, do_sample=not greedy, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, temperature=1.0, top_k=0, top_p=1.0)
        t = time.perf_counter()
        res = model.generate_batch(inputs, generation_config=gcfg, progress_bar=False)
        secs = time.perf_counter() - t
        outs = list(res.values())
        if len(outs) < take or any(o.error for o in outs):
            raise RuntimeError(f"{take - len(outs)} of {take} requests missing or failed")
        ids = torch.full((take, n.max() + w.max_new), tok.pad_token_id)
        for i, o in enumerate(outs):
            row = o.prompt_ids + o.generated_tokens
            ids[i, : len(row)] = torch.tensor(row)
        return sum(len(o.generated_tokens) for o in outs), secs, ids
    static = engine == "static+compile"
    engine, _, mode = engine.partition(":")  # continuous:<policy.generation.decode_mode>
    cfg = GenerationConfig(max_new_tokens=w.max_new, engine="generate" if static else engine,
                           share_prompt_prefill=not static, decode_mode=mode or "dynamic")
    t = time.perf_counter()
    out = hf_generate(model, tok, data, cfg, greedy=greedy, max_total_length=w.max_total,
                      micro_batch_size=w.micro_batch, synced=False, device=DEVICE)
    secs = time.perf_counter() - t
    return int(out["generation_lengths"].sum()), secs, out["output_ids"]


def same_tokens(ids: torch.Tensor, ref: torch.Tensor | None, pad: int, prefix: bool) -> bool:
    """Row by row, trailing padding aside. prefix: `ids` may run past ref's per-sample budget."""
    if ref is None or len(ids) != len(ref):
        return False
    for a, b in zip(ids.tolist(), ref.tolist()):
        while a and a[-1] == pad:
            a.pop()
        while b and b[-1] == pad:
            b.pop()
        if (a[: len(b)] if prefix else a) != b:
            return False
    return True


def set_static_compile(model, on: bool) -> None:
    from transformers.generation.configuration_utils import CompileConfig

    gc = model.generation_config
    if on:
        cc = CompileConfig(fullgraph=False, dynamic=False, mode="default")
        cc._compile_all_devices = True  # transformers only auto-compiles on accelerators otherwise
        gc.cache_implementation, gc.compile_config = "static", cc
    else:
        gc.cache_implementation, gc.compile_config = None, None


def bench_model(label: str, model, tok, works: list[Work], engines: list[str], args) -> list[tuple]:
    rows = []
    for w in works:
        check = BatchedDataDict({k: v[: args.check] for k, v in w.data.items()})
        ref = None
        results: dict[str, list] = {e: [] for e in engines}
        status: dict[str, str] = {}
        for e in engines:  # greedy equality first; it also warms each engine up (and compiles)
            try:
                compiles = e == "static+compile" or e.endswith((":compiled", ":graphs"))
                if e == "static+compile":
                    set_static_compile(model, True)
                if compiles:
                    _alarm(args.compile_timeout)
                t = time.perf_counter()
                check_model = getattr(args, "check_model", None)
                if compiles and e != "static+compile" and check_model is not None:
                    # Compiled for the timed workload's shapes on the bfloat16 model; the float32 check
                    # runs the same fixed shapes eagerly (compiling the check model too costs GPU minutes;
                    # compiled against eager steps are compared in tests/unit/models/test_static_decode.py).
                    run_engine(e, model, tok, w, False)
                    run_engine(e, model, tok, w, False)  # sampled rows end at other steps: other shapes
                    signal.alarm(0)
                    took = time.perf_counter() - t
                    _, _, ids = run_engine("continuous:static", check_model, tok, w, True, data=check)
                    same = same_tokens(ids, ref, tok.pad_token_id, prefix=False)
                    status[e] = (f"{'equal' if same else 'DIFFERS'} (its shapes eagerly, float32; first call, "
                                 f"compiling: {took:.0f} s)")
                    continue
                if e == "static+compile" and check_model is not None:
                    # The compiled model is the bfloat16 one: compile it for the timed workload's shapes
                    # (under the alarm); its greedy tokens are not compared (see below).
                    run_engine(e, model, tok, w, False, cb_cap=args.cb_samples)
                    signal.alarm(0)
                    status[e] = f"not compared (bfloat16; first call, compiling: {time.perf_counter() - t:.0f} s)"
                    continue
                # On a GPU the check runs in float32 (args.check_model): bfloat16 logits of two
                # batchings differ in their last bits, which flips near ties.
                _, _, ids = run_engine(e, check_model or model, tok, w, True, data=check, cb_cap=args.check)
                if compiles and e != "static+compile":  # its traces for the workload's shapes too
                    run_engine(e, model, tok, w, False)
                    run_engine(e, model, tok, w, False)
                signal.alarm(0)
                warm = time.perf_counter() - t
                if e == "generate":
                    ref = ids
                    status[e] = "reference"
                else:
                    status[e] = "equal" if same_tokens(ids, ref, tok.pad_token_id, prefix=e == "generate_batch") else "DIFFERS"
                if compiles:
                    status[e] += f" (first call, compiling: {warm:.0f} s)"
            except Exception as ex:  # noqa: BLE001 - a failed engine is a row, not the end of the run
                signal.alarm(0)
                status[e] = f"failed: {type(ex).__name__}: {str(ex).splitlines()[0][:90] if str(ex) else ''}"
            finally:
                set_static_compile(model, False)
        traces = _traces()
        for _ in range(args.reps):
            for e in engines:
                if status[e].startswith("failed"):
                    continue
                set_static_compile(model, e == "static+compile")
                torch.manual_seed(0)
                try:
                    toks, secs, _ = run_engine(e, model, tok, w, False, cb_cap=args.cb_samples)
                    results[e].append((toks / secs, toks, secs))
                except Exception as ex:  # noqa: BLE001
                    status[e] = f"failed: {type(ex).__name__}: {str(ex).splitlines()[0][:90]}"
                finally:
                    set_static_compile(model, False)
        if _traces() > traces:  # the timed runs include compile time: say so
            for e in engines:
                if e.endswith((":compiled", ":graphs")) and not status[e].startswith("failed"):
                    status[e] += f"; {_traces() - traces} trace(s) compiled while timed"
        base = max(results["generate"])[0] if results["generate"] else None
        for e in engines:
            if status[e].startswith("failed") or not results[e]:
                rows.append((label, w.name, e, "-", "-", "-", "-", status[e]))
                continue
            tps, toks, secs = max(results[e])
            speed = f"{tps / base:.2f}x" if base else "-"
            rows.append((label, w.name, e, f"{tps:,.0f}", speed, str(toks), f"{secs:.2f}", status[e]))
            print(f"  {label} {w.name} {e}: {tps:,.0f} tok/s", file=sys.stderr, flush=True)
    return rows


def _traces() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def step_overhead(model, tok, args) -> str:
    """Milliseconds per decode step with one sample: the model's work is smallest, so this is mostly each
    engine's fixed cost per step (Python, mask building, processors, stopping checks)."""
    data = grpo_prompts(5, len(tok), 1, 1, tok.pad_token_id, seed=2)
    stop = BatchedDataDict(dict(data) | {"stop_strings": [["</tool_call>"]]})  # a tool turn's stop string
    parts = []
    for label, d in (("", data), (" with a stop string", stop)):
        w = Work("one", d, 56, 200, 1)
        for e in ("generate", "continuous"):
            runs = [run_engine(e, model, tok, w, True)[:2] for _ in range(max(15, args.reps))]  # greedy: same
            parts.append(f"{e}{label} {min(secs / toks for toks, secs in runs) * 1e3:.2f} ms")
    return ", ".join(parts)


def print_table(rows: list[tuple]) -> None:
    head = ("model", "workload", "engine", "tokens/s", "vs generate", "tokens", "seconds", "greedy")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def main_gpu(args, argv: list[str]) -> int:
    """The GPU target's workload: 256 samples of the SmolLM2-135M shape in bfloat16, decoded together."""
    cuda = DEVICE.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible", file=sys.stderr)
        return 2
    print("command: python benchmarks/bench_generation.py " + " ".join(argv))
    print(f"device: {torch.cuda.get_device_name(DEVICE) if cuda else 'cpu'}, torch {torch.__version__}")
    engines = ["generate", "continuous", "continuous:static", "continuous:graphs", "generate_batch"] + (
        [] if args.skip_compile else ["static+compile"])
    if args.engines:
        engines = ["generate"] + [e for e in args.engines.split(",") if e != "generate"]
    with tempfile.TemporaryDirectory() as d:
        tok = build_char_tokenizer(d, extra_tokens=TOOL_TOKENS)
    model = smollm2_shaped(49152, tok.pad_token_id, tok.eos_token_id).to(DEVICE)
    if cuda:
        args.check_model = copy.deepcopy(model)  # float32, for the greedy check
        model = model.to(torch.bfloat16)
    n_p = 16 if args.quick else 64
    data = grpo_prompts(5, len(tok), n_p, 4, tok.pad_token_id, seed=1)
    new = args.gpu_new_tokens
    works = [Work(f"batch {4 * n_p}", data, new, 64 + new, 4 * n_p)]
    args.cb_samples = max(args.cb_samples, 4 * n_p)  # generate_batch is built for this case: all of them
    print(f"smollm2-135m-shaped, {model.dtype}: {n_p} prompts x G=4 (prompt lengths 20-60), max_new_tokens {new}, "
          f"micro batch / slots {4 * n_p}; greedy compared on the first {args.check} samples")
    rows = bench_model("smollm2-135m", model, tok, works, engines, args)
    if cuda:
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated(DEVICE) / 2**30:.2f} GiB")
    print_table(rows)
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples and one rep: a smoke run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--compile-timeout", type=int, default=300)
    ap.add_argument("--cb-samples", type=int, default=16, help="samples given to generate_batch (it is slow)")
    ap.add_argument("--check", type=int, default=24, help="samples whose greedy tokens are compared")
    ap.add_argument("--engines", default=None,
                    help="comma-separated engines instead of the default set (generate always runs: the "
                         "reference), e.g. continuous,continuous:graphs; continuous:<decode_mode> sets "
                         "policy.generation.decode_mode")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU workload (batch 256)")
    ap.add_argument("--gpu-workload", action="store_true",
                    help="the batch-256 workload (implied by --device cuda; on a CPU: a smoke run of it)")
    ap.add_argument("--gpu-new-tokens", type=int, default=128, help="the batch-256 workload: new tokens per sample")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" or args.gpu_workload:
        return main_gpu(args, argv)
    if args.quick:
        args.reps = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    print("command: uv run benchmarks/bench_generation.py " + " ".join(argv))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), load average before: {os.getloadavg()[0]:.1f}")
    engines = ["generate", "continuous", "continuous:static", "generate_batch"] + (
        [] if args.skip_compile else ["continuous:compiled", "static+compile"])
    if args.engines:
        engines = ["generate"] + [e for e in args.engines.split(",") if e != "generate"]

    with tempfile.TemporaryDirectory() as d:
        tok = build_char_tokenizer(d, extra_tokens=TOOL_TOKENS)
    lo, hi = 5, len(tok)  # ordinary tokens only
    tiny = build_tiny_llama(tok, hidden_size=128, num_layers=4, num_heads=4, max_position_embeddings=160).float().eval()
    n_p = 12 if args.quick else 48
    tw = grpo_prompts(lo, hi, n_p, 4, tok.pad_token_id, seed=0)
    works = [Work("full", tw, 56, 160, 192), Work("ragged", tw, 56, 76, 192)]
    print(f"tiny: hidden 128, 4 layers, 4 heads, vocab {len(tok)}; {n_p} prompts x G=4 (prompt lengths "
          f"20-60), max_new_tokens 56, micro batch / slots 192; full: max_total 160 (every budget 56); "
          "ragged: max_total 76 (budgets 16-56 by prompt length)")
    print(f"tiny, one sample of 56 tokens, per decode step: {step_overhead(tiny, tok, args)}")
    rows = bench_model("tiny", tiny, tok, works, engines, args)

    if not args.skip_smollm2:
        small = smollm2_shaped(49152, tok.pad_token_id, tok.eos_token_id)
        n_p = 2 if args.quick else 8
        sw = grpo_prompts(lo, hi, n_p, 4, tok.pad_token_id, seed=1)
        works = [Work("full", sw, 32, 160, 16), Work("ragged", sw, 32, 76, 16)]
        print(f"smollm2-135m-shaped: hidden 576, 30 layers, 9/3 heads, vocab 49152, tied; {n_p} prompts x "
              "G=4, max_new_tokens 32, micro batch / slots 16; full: max_total 160; ragged: max_total 76 "
              "(budgets 16-32 by prompt length)")
        rows += bench_model("smollm2-135m", small, tok, works, engines, args)

    print(f"load average after: {os.getloadavg()[0]:.1f}; generate_batch runs the first "
          f"{args.cb_samples} samples with max_new_tokens for all (no per-sample budgets); "
          f"greedy compared on the first {args.check} samples")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
