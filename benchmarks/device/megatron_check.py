"""Megatron-core GPTModel against the HF model it is mapped from, on one GPU, one process, no Ray.

    python3 benchmarks/device/megatron_check.py --model <HF folder> --json $OUT/megatron.json
    python3 benchmarks/device/megatron_check.py --model <HF folder> --dry-run     # CPU: build + load only
    python3 benchmarks/device/megatron_check.py --model <HF folder> --device cpu  # CPU: every step (slow)

Steps (each timed; a failure is recorded and printed, and the later steps still try):
  env             versions, GPU, torch.distributed + megatron's parallel state (TP = PP = 1)
  load_hf         AutoModelForCausalLM in bf16 on the device
  build_megatron  GPTModel (local spec) in bf16 on the device, loaded with the mapped HF weights (strict)
  logprobs_bf16   per-token next-token log-probs of both on 4 right-padded texts: max/mean |diff| over
                  real tokens (and of the logits)
  logprobs_fp32   the same with both models in float32 (TF32 off), and HF bf16 against HF fp32 as the
                  scale of what bf16 alone moves
  train_step      one AdamW step (fp32 master weights, bf16 model) on loss = -mean log-prob: finite,
                  lower on a second forward of the same batch
  export          Megatron -> HF state dict, strict load into a fresh HF model: logits against the
                  Megatron model's after the step; save_pretrained + from_pretrained of that folder
  worker          MegatronPolicyWorker against HFPolicyWorker in this process (bf16): log-probs, one
                  NLL training step, log-probs after, a checkpoint reload (skipped when the project's
                  own dependencies do not import; --no-worker leaves it out)

--device cpu runs it all on the CPU (gloo; megatron's CUDA-only bits pointed at the CPU), to check the
script itself before a GPU run; --dry-run stops after build_megatron.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Water boils at one hundred degrees Celsius at sea level, but at the top of a high mountain the air "
    "pressure is lower, so it boils at a lower temperature and food takes longer to cook.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "In a small village by the sea there lived an old fisherman who went out every morning before dawn. "
    "He knew the winds and the currents better than anyone, and the younger fishermen often asked him "
    "where the fish would be. One winter the storms came early and for many weeks no boat could leave "
    "the harbour, so the village shared what it had stored during the summer.",
]


def _load_mapping():
    """nemo_like.models.policy.megatron_mapping by file: importing it through the package would run
    nemo_like.models.policy's __init__ (pydantic and the rest), which a bare GPU image may lack."""
    folder = ROOT / "nemo_like" / "models" / "policy"
    # megatron_mapping imports megatron_dims by its package path: that module (plain Python) is loaded
    # by file first under that name, so the import finds it without the package's __init__.
    for name, module_name in (("megatron_dims", "nemo_like.models.policy.megatron_dims"),
                              ("megatron_mapping", "megatron_mapping")):
        spec = importlib.util.spec_from_file_location(module_name, folder / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = mod
        spec.loader.exec_module(mod)
    return mod


mm = _load_mapping()


class Report:
    def __init__(self, json_path: str | None):
        self.json_path = json_path
        self.data: dict = {"steps": {}}

    @contextlib.contextmanager
    def step(self, name: str, device: torch.device):
        rec: dict = {"ok": False}
        self.data["steps"][name] = rec
        print(f"--- {name}", flush=True)
        t0 = time.perf_counter()
        try:
            yield rec
            rec["ok"] = True
        except Exception as e:  # recorded, printed; the next steps still try
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()
            print(rec["traceback"], flush=True)
        finally:
            if device.type == "cuda":
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
            rec["seconds"] = round(time.perf_counter() - t0, 3)
            print(f"    {'ok' if rec['ok'] else 'FAILED'} in {rec['seconds']} s", flush=True)
            self.write()

    def write(self) -> None:
        self.data["ok"] = all(r.get("ok") for r in self.data["steps"].values())
        if self.json_path:
            Path(self.json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.json_path).write_text(json.dumps(self.data, indent=2, default=str))


def _batch(tokenizer, device):
    enc = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    lengths = torch.tensor([len(e) for e in enc])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    ids = torch.full((len(enc), int(lengths.max())), pad, dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = torch.tensor(e)
    real = torch.arange(ids.shape[1])[None] < lengths[:, None]  # [b, s] real tokens
    scored = real.clone()
    scored[:, 0] = False  # position 0 has no prediction
    return ids.to(device), lengths, real.to(device), scored.to(device)


def _hf_logits(model, ids, real):
    return model(input_ids=ids, attention_mask=real.long(), use_cache=False).logits


def _diffs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    d = (a.float() - b.float()).abs()[mask]
    return {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean())}


def _compare(hf, mc, ids, real, scored) -> dict:
    with torch.no_grad():
        hl = _hf_logits(hf, ids, real)
        ml = mm.gpt_logits(mc, ids)
        out = {"logprob": _diffs(mm.token_logprobs_from_logits(hl, ids), mm.token_logprobs_from_logits(ml, ids), scored),
               "logits": _diffs(hl, ml, real),
               "argmax_agreement": float((hl.argmax(-1) == ml.argmax(-1))[real].float().mean()),
               "mean_logprob_hf": float(mm.token_logprobs_from_logits(hl, ids)[scored].mean())}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF folder (save_pretrained layout, with its tokenizer)")
    ap.add_argument("--json", default=None, help="where to write every number (JSON)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: build the GPTModel, map and load the weights, stop")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate of the training step")
    ap.add_argument("--skip-fp32", action="store_true", help="leave out the float32 comparison")
    ap.add_argument("--no-worker", action="store_true",
                    help="leave out the last step, MegatronPolicyWorker against HFPolicyWorker in process")
    args = ap.parse_args(argv)

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cpu = args.dry_run or args.device == "cpu"
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    bf16 = torch.bfloat16
    rep = Report(args.json)
    rep.data.update(model=args.model, mode="dry-run" if args.dry_run else args.device, lr=args.lr)
    state: dict = {}
    rep_stack = contextlib.ExitStack()  # --device cpu: megatron's CUDA-only bits on the CPU until the end
    t_all = time.perf_counter()

    with rep.step("env", device) as r:
        mm.require_megatron()  # the error names the extra to install
        import megatron.core

        r.update(python=sys.version.split()[0], torch=torch.__version__, megatron_core=megatron.core.__version__)
        import transformers

        r["transformers"] = transformers.__version__
        r["transformer_engine"] = importlib.util.find_spec("transformer_engine") is not None
        r["apex"] = importlib.util.find_spec("apex") is not None
        if not cpu:
            r["gpu"] = torch.cuda.get_device_name(0)
            torch.cuda.set_device(0)
        for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(mm.free_port())), ("RANK", "0"),
                     ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(k, v)
        if cpu:
            mm.init_model_parallel("gloo")
            if not args.dry_run:
                rep_stack.enter_context(mm.cpu_forward_context())
        else:
            mm.init_model_parallel("nccl", seed=0)
        state["hf_config"] = AutoConfig.from_pretrained(args.model)
        dims = mm.model_dims(state["hf_config"])
        r["model_dims"] = {k: getattr(dims, k) for k in dims.__dataclass_fields__}
        torch.manual_seed(0)
    hf_config = state.get("hf_config")

    with rep.step("load_hf", device) as r:
        state["tok"] = AutoTokenizer.from_pretrained(args.model)
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=bf16).to(device).eval()
        state["hf"] = hf
        r["num_parameters"] = sum(p.numel() for p in hf.parameters())
        r["attn_implementation"] = getattr(hf.config, "_attn_implementation", None)

    with rep.step("build_megatron", device) as r:
        t0 = time.perf_counter()
        mc = mm.build_gpt_model(hf_config, params_dtype=bf16, use_cpu_initialization=cpu, perform_initialization=False)
        r["build_seconds"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        sd = mm.hf_to_megatron_state_dict(state["hf"].state_dict(), hf_config)
        mm.load_megatron_state_dict(mc, sd)
        r["map_and_load_seconds"] = round(time.perf_counter() - t0, 3)
        own = mm.megatron_state_dict(mc)
        r["num_tensors"] = len(own)
        r["num_parameters"] = sum(p.numel() for p in mc.parameters())
        r["dtypes"] = sorted({str(p.dtype) for p in mc.parameters()})
        r["devices"] = sorted({str(p.device) for p in mc.parameters()})
        r["exact_after_load"] = all(torch.equal(own[k], sd[k]) for k in sd)
        r["sample_keys"] = [k for k in own if k.startswith(("embedding", "decoder.layers.0.", "decoder.final", "output"))]
        mc.eval()
        state["mc"] = mc
        del sd, own

    if args.dry_run:
        rep.data["total_seconds"] = round(time.perf_counter() - t_all, 3)
        rep.write()
        _print_table(rep.data)
        return 0 if rep.data["ok"] else 1

    with rep.step("logprobs_bf16", device) as r:
        ids, lengths, real, scored = _batch(state["tok"], device)
        state["batch"] = (ids, real, scored)
        r["lengths"] = lengths.tolist()
        r.update(_compare(state["hf"], state["mc"], ids, real, scored))

    if not args.skip_fp32:
        with rep.step("logprobs_fp32", device) as r:
            if device.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = False
                torch.backends.cudnn.allow_tf32 = False
            ids, real, scored = state["batch"]
            hf32 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
            mc32 = mm.build_gpt_model(hf_config, params_dtype=torch.float32, use_cpu_initialization=cpu,
                                      perform_initialization=False).eval()
            mm.load_megatron_state_dict(mc32, mm.hf_to_megatron_state_dict(hf32.state_dict(), hf_config))
            r.update(_compare(hf32, mc32, ids, real, scored))
            with torch.no_grad():  # the scale bf16 alone moves things: HF bf16 against HF fp32
                lp16 = mm.token_logprobs_from_logits(_hf_logits(state["hf"], ids, real), ids)
                lp32 = mm.token_logprobs_from_logits(_hf_logits(hf32, ids, real), ids)
            r["hf_bf16_vs_hf_fp32_logprob"] = _diffs(lp16, lp32, scored)
            del hf32, mc32
            if device.type == "cuda":
                torch.cuda.empty_cache()

    with rep.step("train_step", device) as r:
        mc = state["mc"]
        ids, real, scored = state["batch"]
        params = [p for p in mc.parameters() if p.requires_grad]
        master = [p.detach().float().clone().requires_grad_(True) for p in params]  # fp32 master weights
        opt = torch.optim.AdamW(master, lr=args.lr, weight_decay=0.0)
        mc.train()

        def loss_fn():
            lp = mm.token_logprobs_from_logits(mm.gpt_logits(mc, ids), ids)
            return -lp[scored].mean()

        loss0 = loss_fn()
        loss0.backward()
        for m, p in zip(master, params):
            m.grad = None if p.grad is None else p.grad.float()
        missing = sum(p.grad is None for p in params)
        grad_norm = torch.nn.utils.clip_grad_norm_(master, 1.0)
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m)
                p.grad = None
        mc.eval()
        with torch.no_grad():
            loss1 = loss_fn()
        loss0, loss1 = loss0.detach(), loss1.detach()
        r.update(loss_before=float(loss0), loss_after=float(loss1), grad_norm=float(grad_norm),
                 params_without_grad=int(missing), loss_finite=bool(torch.isfinite(loss0) and torch.isfinite(loss1)),
                 loss_decreased=bool(loss1 < loss0))
        if not (r["loss_finite"] and r["loss_decreased"] and missing == 0 and math.isfinite(r["grad_norm"])):
            raise AssertionError(f"training step: loss {float(loss0):.4f} -> {float(loss1):.4f}, "
                                 f"grad norm {float(grad_norm):.4f}, {missing} parameters without a gradient")
        del master, opt

    with rep.step("export", device) as r:
        mc = state["mc"]
        ids, real, scored = state["batch"]
        own = mm.megatron_state_dict(mc)
        hf_sd = mm.megatron_to_hf_state_dict(own, hf_config, with_tied_lm_head=True)
        back = mm.hf_to_megatron_state_dict(hf_sd, hf_config)
        r["round_trip_exact"] = all(torch.equal(back[k], own[k]) for k in own)
        # dtype= at construction, not .to(bf16): that would also round the rotary inv_freq buffer,
        # which HF keeps in float32.
        fresh = AutoModelForCausalLM.from_config(hf_config, dtype=bf16).to(device).eval()
        fresh.load_state_dict(hf_sd, strict=True)
        with torch.no_grad():
            fl = _hf_logits(fresh, ids, real)
            ml = mm.gpt_logits(mc, ids)
        r["exported_vs_megatron"] = {"logits": _diffs(fl, ml, real), "logprob": _diffs(
            mm.token_logprobs_from_logits(fl, ids), mm.token_logprobs_from_logits(ml, ids), scored)}
        with torch.no_grad():
            orig = _hf_logits(state["hf"], ids, real)
        r["changed_by_step_logits_max_abs"] = float((fl.float() - orig.float()).abs()[real].max())
        with tempfile.TemporaryDirectory() as tmp:
            fresh.save_pretrained(tmp)
            state["tok"].save_pretrained(tmp)
            reloaded, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=bf16, output_loading_info=True)
            reloaded = reloaded.to(device).eval()
            r["reload_loading_info"] = {k: sorted(v) if isinstance(v, (set, list)) else str(v) for k, v in info.items()}
            with torch.no_grad():
                rl = _hf_logits(reloaded, ids, real)
            r["reloaded_vs_exported_logits_max_abs"] = float((rl.float() - fl.float()).abs()[real].max())
        bad = {k: v for k, v in r["reload_loading_info"].items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad or not r["round_trip_exact"]:
            raise AssertionError(f"export: round trip exact {r['round_trip_exact']}, reload problems {bad}")

    if not args.no_worker:
        state.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _worker_step(rep, device, args)

    rep.data["total_seconds"] = round(time.perf_counter() - t_all, 3)
    rep.write()
    _print_table(rep.data)
    with contextlib.suppress(Exception):
        import torch.distributed as dist
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if rep.data["ok"] else 1


def _worker_step(rep: Report, device: torch.device, args) -> None:
    """MegatronPolicyWorker against HFPolicyWorker in this process (bf16, no Ray): log-probs, one
    NLL training step, log-probs after it. Skipped (not failed) when the project's own dependencies
    (pydantic, ray, ...) are not importable here."""
    sys.path.insert(0, str(ROOT))
    try:
        from nemo_like.algorithms.loss_functions import NLLLossFn
        from nemo_like.distributed.batched_data_dict import BatchedDataDict
        from nemo_like.models.policy.hf_worker import HFPolicyWorker
        from nemo_like.models.policy.interfaces import PolicyConfig
        from nemo_like.models.policy.megatron_worker import MegatronPolicyWorker
    except Exception as e:  # a bare GPU image without the project's dependencies (ray, pydantic, ...)
        rep.data["steps"]["worker"] = {"ok": True, "skipped": f"project imports failed: {e}"}
        print(f"--- worker skipped: {e}", flush=True)
        rep.write()
        return
    with rep.step("worker", device) as r:
        os.environ["NEMO_LIKE_USE_GPU"] = "1" if device.type == "cuda" else "0"
        cfg = PolicyConfig(model_name=args.model, precision="bfloat16", train_global_batch_size=4,
                           train_micro_batch_size=2, logprob_batch_size=4, max_total_sequence_length=512,
                           optimizer={"lr": args.lr})
        from transformers import AutoTokenizer

        ids, lengths, real, scored = _batch(AutoTokenizer.from_pretrained(args.model), torch.device("cpu"))
        data = BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=scored.float(),
                               sample_mask=torch.ones(len(lengths)))
        t0 = time.perf_counter()
        mw = MegatronPolicyWorker(cfg, seed=0)
        r["megatron_init_seconds"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        hw = HFPolicyWorker(cfg, seed=0)
        r["hf_init_seconds"] = round(time.perf_counter() - t0, 3)
        r["checksum_equal_before_training"] = mw.weights_checksum() == hw.weights_checksum()
        lm, lh = mw.get_logprobs(data)["logprobs"], hw.get_logprobs(data)["logprobs"]
        r["logprob_vs_hf_worker"] = _diffs(lm, lh, scored)
        ref = mw.get_reference_policy_logprobs(data)["reference_logprobs"]
        r["reference_equals_current_before_training"] = bool(torch.equal(ref, lm))
        for name, w in (("megatron", mw), ("hf", hw)):
            t0 = time.perf_counter()
            m = w.train(data, NLLLossFn())
            r[f"train_{name}"] = {k: m[k] for k in ("loss", "grad_norm", "peak_memory_gb") if k in m} | {
                "seconds": round(time.perf_counter() - t0, 3)}
        lm2, lh2 = mw.get_logprobs(data)["logprobs"], hw.get_logprobs(data)["logprobs"]
        r["after_step_logprob_vs_hf_worker"] = _diffs(lm2, lh2, scored)
        r["after_step_moved_megatron"] = _diffs(lm2, lm, scored)
        ref2 = mw.get_reference_policy_logprobs(data)["reference_logprobs"]
        r["reference_unchanged_by_training"] = bool(torch.equal(ref2, ref))
        with tempfile.TemporaryDirectory() as tmp:
            mw.save_checkpoint(tmp)
            again = MegatronPolicyWorker(cfg, seed=0, init_reference_model=False)
            again.load_checkpoint(tmp)
            r["checkpoint_reload_logprob_max_abs"] = float((again.get_logprobs(data)["logprobs"] - lm2).abs().max())
        del mw, hw, again


def _print_table(data: dict) -> None:
    rows = []
    for name, r in data["steps"].items():
        note = ""
        if not r.get("ok"):
            note = r.get("error", "")[:100]
        elif name == "build_megatron":
            note = f"{r['num_parameters']:,} params {r['dtypes']} exact={r['exact_after_load']}"
        elif name.startswith("logprobs"):
            note = (f"logprob |d| max {r['logprob']['max_abs_diff']:.2e} mean {r['logprob']['mean_abs_diff']:.2e}; "
                    f"logits max {r['logits']['max_abs_diff']:.2e}; argmax agree {r['argmax_agreement']:.3f}")
            if "hf_bf16_vs_hf_fp32_logprob" in r:
                b = r["hf_bf16_vs_hf_fp32_logprob"]
                note += f"; (HF bf16 vs fp32: max {b['max_abs_diff']:.2e} mean {b['mean_abs_diff']:.2e})"
        elif name == "train_step":
            note = f"loss {r['loss_before']:.4f} -> {r['loss_after']:.4f}, grad norm {r['grad_norm']:.3f}"
        elif name == "export":
            e = r["exported_vs_megatron"]
            note = (f"exported HF vs megatron logits max {e['logits']['max_abs_diff']:.2e}, logprob max "
                    f"{e['logprob']['max_abs_diff']:.2e}; reload diff {r['reloaded_vs_exported_logits_max_abs']:.1e}")
        elif name == "worker" and "skipped" in r:
            note = "skipped: " + r["skipped"][:90]
        elif name == "worker":
            tm, th = r["train_megatron"], r["train_hf"]
            note = (f"logprob vs HF worker max {r['logprob_vs_hf_worker']['max_abs_diff']:.2e}; loss {tm['loss']:.4f} "
                    f"(HF {th['loss']:.4f}), grad norm {tm['grad_norm']:.3f} (HF {th['grad_norm']:.3f}); after step "
                    f"max {r['after_step_logprob_vs_hf_worker']['max_abs_diff']:.2e}; train {tm['seconds']:.2f}s "
                    f"(HF {th['seconds']:.2f}s)")
        elif name == "env":
            note = f"torch {r.get('torch')} megatron-core {r.get('megatron_core')} {r.get('gpu', 'cpu')}"
        rows.append((name, "ok" if r.get("ok") else "FAIL", f"{r.get('seconds', 0):.1f}s", note))
    print()
    for row in rows:
        print(f"{row[0]:<15} {row[1]:<5} {row[2]:>7}  {row[3]}")
    print(f"total {data.get('total_seconds', 0):.1f}s, all ok: {data['ok']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
