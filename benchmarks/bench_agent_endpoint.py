"""The OpenAI endpoint against the in-process path, in one run: GRPO step time, concurrent sessions,
and a fuzz of hostile requests.

    uv run benchmarks/bench_agent_endpoint.py                       # all three parts
    uv run benchmarks/bench_agent_endpoint.py --parts load fuzz     # no GRPO runs
    uv run benchmarks/bench_agent_endpoint.py --steps 6 --json agent.json

1. **steps**: the tool task trained by GRPO for ``--steps`` steps twice from the same base model,
   each in a fresh subprocess: through the in-process tool environment (the model's turns generated
   by the trainer, graded by the tool actor), and through the endpoint with the agent program
   ``examples/agents/calculator.py`` (the same turns, requested over HTTP by the program and
   recorded by the server). Seconds per step are the mean of the steps after the first.
2. **load**: ``--sessions`` concurrent sessions, each a two-turn chat, against a server over the
   tiny model's continuous engine; generated tokens per second against the same prompts submitted
   to that engine directly (no HTTP). Errors counted.
3. **fuzz**: ``--fuzz`` malformed or hostile requests (bad JSON, wrong types, huge bodies, unknown
   fields, bad tool schemas, wrong keys, ended sessions, unknown routes); counts by status, and
   whether the server still answers a good request afterwards. No request may get a 500.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AGENT_CONFIG = ROOT / "examples" / "configs" / "grpo_agent_tiny.yaml"
QUIET = ["checkpointing.enabled=false", "logger.tensorboard_enabled=false", "logger.stdout_enabled=false",
         "grpo.val_period=0"]

STEP_CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
from nemo_like.algorithms.grpo_run import setup
from nemo_like.config import load_config
cfg = load_config({config!r}, {overrides!r})
trainer = setup(cfg)
times = []
try:
    for _ in range(cfg.grpo.max_num_steps):
        t0 = time.perf_counter()
        m = trainer.step()
        times.append(time.perf_counter() - t0)
finally:
    trainer.close()
print("RESULT " + json.dumps({{"times": times, "reward": m.get("train/reward_mean")}}))
"""


def run_steps(steps: int, extra: list[str]) -> dict[str, dict]:
    """Seconds per GRPO step, in-process tool environment against the endpoint and agent program."""
    base = [f"grpo.max_num_steps={steps}", *QUIET, *extra]
    # The same problems (all three kinds, as the tool task's recipes train), turns and limits; only who
    # drives the episode differs.
    gen = "generator: {kind: tool, split: train, num_samples: 6000, seed: 1, weights: [1, 1, 2]}"
    sides = {
        "in-process tool env": base + [f"data.train={{task_name: calculator, env_name: tool, {gen}}}",
                                       "data.validation=null", "env.tool.max_turns=3", "env.tool.call_match_reward=0.5"],
        "endpoint + agent": base + [f"data.train={{task_name: calculator, env_name: agent, {gen}}}",
                                    "data.validation=null"],
    }
    out = {}
    for name, overrides in sides.items():
        code = STEP_CHILD.format(root=str(ROOT), config=str(AGENT_CONFIG), overrides=overrides)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        res = json.loads(line[7:])
        later = res["times"][1:] or res["times"]
        out[name] = {"s_per_step": sum(later) / len(later), "reward": res["reward"], "wall_s": time.perf_counter() - t0}
        print(f"[bench] {name}: {out[name]['s_per_step']:.2f} s/step", flush=True)
    return out


def tiny_server(tmp: str, slots: int, model: str | None = None, decode_mode: str = "dynamic"):
    """A server over ``model`` (what ``policy.model_name`` takes; on a GPU when there is one), or over the
    tiny model built in ``tmp``."""
    from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama
    from nemo_like.serve.loading import load_engine
    from nemo_like.serve.server import start_server

    if model is None:
        tok = build_char_tokenizer(tmp)
        build_tiny_llama(tok, hidden_size=128, num_layers=4, num_heads=4, max_position_embeddings=512, seed=0,
                         save_dir=tmp)
    engine = load_engine(model or tmp, max_num_seqs=slots, decode_mode=decode_mode)
    return engine, start_server(engine, model_name="tiny")


def run_load(sessions: int, slots: int, tokens: int, model: str | None = None, decode_mode: str = "dynamic") -> dict:
    """``sessions`` two-turn chats at once over HTTP, against the same turns on the engine directly."""
    import openai

    from nemo_like.serve.engines import GenParams

    with tempfile.TemporaryDirectory() as tmp:
        engine, server = tiny_server(tmp, slots, model, decode_mode)
        try:
            async def direct() -> int:  # the engine without HTTP: the same prompts, the same budgets
                tok = engine.tokenizer
                prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"problem {i}"}], tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False)["input_ids"]
                           for i in range(sessions)]
                outs = await asyncio.gather(*[engine.generate(p, GenParams(max_new_tokens=tokens)) for p in prompts])
                return sum(len(o.token_ids) for o in outs)

            async def over_http() -> tuple[int, int]:
                errors, generated = 0, 0

                async def episode(i: int) -> int:
                    s = server.sessions.open(tag=i)
                    c = openai.AsyncOpenAI(base_url=server.base_url, api_key=s.key, max_retries=0, timeout=600)
                    msgs = [{"role": "user", "content": f"problem {i}"}]
                    n = 0
                    try:
                        for _ in range(2):
                            r = await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=tokens)
                            n += r.usage.completion_tokens
                            msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                                     {"role": "user", "content": "and?"}]
                    finally:
                        await c.close()
                    return n
                results = await asyncio.gather(*[episode(i) for i in range(sessions)], return_exceptions=True)
                for r in results:
                    if isinstance(r, BaseException):
                        errors += 1
                    else:
                        generated += r
                return generated, errors

            asyncio.run(direct())  # warm-up
            t0 = time.perf_counter()
            d_tokens = asyncio.run(direct())
            d_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            h_tokens, errors = asyncio.run(over_http())
            h_s = time.perf_counter() - t0
            return {"sessions": sessions, "errors": errors, "http_tok_s": h_tokens / h_s, "direct_tok_s": d_tokens / d_s,
                    "http_tokens": h_tokens, "direct_tokens": d_tokens}
        finally:
            server.stop()
            engine.close()


def hostile_requests(n: int, key: str, ended_key: str, rng: random.Random) -> list[tuple[str, str, dict, bytes]]:
    """(method, path, headers, body) of ``n`` malformed or hostile requests."""
    good = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    auth = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    junk = [None, 1, -1, 1e308, "x", [], {}, [1, "a"], {"a": {"b": []}}, True, "\x00\ud800" * 3]

    def mutate() -> tuple[str, str, dict, bytes]:
        kind = rng.randrange(12)
        body = json.loads(json.dumps(good))
        if kind == 0:
            return "POST", "/v1/chat/completions", auth, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        if kind == 1:
            body[rng.choice(list(body))] = rng.choice(junk)
        elif kind == 2:
            body[f"unknown_{rng.randrange(99)}"] = rng.choice(junk)
        elif kind == 3:
            body["messages"] = [{"role": rng.choice(["user", "wizard", "", None]), "content": rng.choice(junk)}]
        elif kind == 4:
            body["tools"] = [{"type": rng.choice(["function", "code"]), "function": rng.choice(
                [{"name": "bad name"}, {"name": "f", "parameters": "nope"}, {}, {"name": "x" * 100}, None])}]
        elif kind == 5:
            return "POST", "/v1/chat/completions", auth, b'{"model": "tiny", "messages": [' + b" " * (9 * 2**20) + b"]}"
        elif kind == 6:
            return "POST", "/v1/chat/completions", {"Authorization": f"Bearer sk-{rng.randrange(10**9)}"}, json.dumps(good).encode()
        elif kind == 7:
            return "POST", "/v1/chat/completions", auth | {"Authorization": f"Bearer {ended_key}"}, json.dumps(good).encode()
        elif kind == 8:
            return rng.choice(["GET", "POST", "DELETE"]), rng.choice(["/v1/engines", "/v2/chat", "/../../etc/passwd", "/v1/models/x"]), auth, b""
        elif kind == 9:
            body["max_tokens"] = rng.choice([0, -5, 10**9, "ten", 2**63])
        elif kind == 10:
            body["messages"] = [{"role": "user", "content": "x" * rng.choice([600, 5000, 200000])}]
        else:
            body = rng.choice([[], "str", 5, None, {"messages": "hi"}, {"model": "tiny"}])
        return "POST", rng.choice(["/v1/chat/completions", "/v1/completions"]), auth, json.dumps(body).encode()
    return [mutate() for _ in range(n)]


def run_fuzz(n: int, seed: int) -> dict:
    import httpx

    with tempfile.TemporaryDirectory() as tmp:
        engine, server = tiny_server(tmp, 16)
        try:
            ended = server.sessions.open()
            server.sessions.end(ended)
            reqs = hostile_requests(n, server.api_key, ended.key, random.Random(seed))
            statuses: Counter = Counter()
            with httpx.Client(base_url=server.url, timeout=120) as c:
                for method, path, headers, body in reqs:
                    try:
                        r = c.request(method, path, headers=headers, content=body)
                        statuses[r.status_code] += 1
                    except httpx.HTTPError as e:
                        statuses[type(e).__name__] += 1
                ok = c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {server.api_key}"},
                            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            return {"requests": n, "statuses": dict(sorted(statuses.items(), key=str)), "server_5xx": sum(
                v for k, v in statuses.items() if isinstance(k, int) and k >= 500), "alive_after": ok.status_code == 200}
        finally:
            server.stop()
            engine.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["steps", "load", "fuzz"], choices=["steps", "load", "fuzz"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--sessions", type=int, default=256)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--fuzz", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--model", default=None, help="load: serve this model (what policy.model_name takes; on the GPU "
                                                 "when there is one) instead of the tiny one")
    p.add_argument("--decode-mode", default="dynamic", choices=["dynamic", "static", "compiled", "graphs"],
                   help="load: the engine's decode step (policy.generation.decode_mode)")
    p.add_argument("overrides", nargs="*", help="key=value for both GRPO runs")
    args = p.parse_args(argv)
    res: dict = {}
    if "steps" in args.parts:
        res["steps"] = run_steps(args.steps, args.overrides)
    if "load" in args.parts:
        res["load"] = run_load(args.sessions, args.slots, args.tokens, args.model, args.decode_mode)
    if "fuzz" in args.parts:
        res["fuzz"] = run_fuzz(args.fuzz, args.seed)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    if "steps" in res:
        a, b = res["steps"]["in-process tool env"], res["steps"]["endpoint + agent"]
        print("\n| path | s/step | last reward |\n|---|---|---|")
        for name, r in res["steps"].items():
            print(f"| {name} | {r['s_per_step']:.2f} | {r['reward']:.3f} |")
        print(f"\nendpoint / in-process: {b['s_per_step'] / a['s_per_step']:.2f}x (target <= 1.15x)")
    if "load" in res:
        r = res["load"]
        print(f"\n| concurrent sessions | errors | tokens/s over HTTP | tokens/s direct | ratio |\n|---|---|---|---|---|\n"
              f"| {r['sessions']} | {r['errors']} | {r['http_tok_s']:.0f} | {r['direct_tok_s']:.0f} | "
              f"{r['http_tok_s'] / r['direct_tok_s']:.2f} |")
    if "fuzz" in res:
        r = res["fuzz"]
        print(f"\nfuzz: {r['requests']} hostile requests; statuses {r['statuses']}; 5xx: {r['server_5xx']}; "
              f"good request answered afterwards: {r['alive_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
