"""How much of the return's variance can any critic explain on a piece of work? The ceiling of
``critic/vf_explained_var``, measured by Monte Carlo, beside what a freshly trained critic reaches.

    uv run benchmarks/value_ceiling.py [--config examples/configs/ppo_math_tiny.yaml] [--model DIR]
        [--samples 300] [--continuations 16] [--fit-samples 3000] [--fit-epochs 4] [--fit-lr 5e-4]

With gamma = lam = 1 and the reward on the last token, the return of every response token is the
episode's reward R, and the best possible value of token t is V*(s_t) = P(R = 1 | the prompt and the
response tokens before t), where the response is sampled by the policy. Explained variance is
1 - Var(R - V) / Var(R) over response tokens, so the best any critic can do is
Var(V*) / Var(R) (R - V* is uncorrelated with V*).

The script samples --samples responses from the policy (temperature 1, as training does), and for
every response token continues the prefix before it --continuations times with the same policy and
grades the continuations: their success rate estimates V*(s_t). Var of that estimate is
Var(V*) + E[V*(1 - V*)] / K; the second term is removed (unbiased, V(1 - V) / (K - 1)).

Then (unless --fit-samples 0) it trains a value model the way the critic is built (the policy's
trunk, a fresh one-output head, values read from the state before each token) on --fit-samples
other responses for --fit-epochs passes, and reports its explained variance on the first ones.

--model is the policy to measure (an HF folder, e.g. a checkpoint's policy weights); by default the
config's base model (the bootstrapped tiny model when the config bootstraps one: it must be cached,
run the config once first). Only math work (``\\boxed{}`` answers graded against the expected one).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nemo_like.algorithms.grpo_setup import build_task_dataset  # noqa: E402
from nemo_like.algorithms.ppo_terms import explained_variance  # noqa: E402
from nemo_like.config import load_config  # noqa: E402
from nemo_like.data.datasets import load_dataset_from_config  # noqa: E402
from nemo_like.environments.math_environment import verify_math_answer  # noqa: E402
from nemo_like.models.critic.worker import load_value_model, shifted_values  # noqa: E402


def _model_folder(cfg, model: str | None) -> str:
    if model:
        return model
    if cfg.bootstrap is not None and cfg.bootstrap.enabled:
        from nemo_like.models.bootstrap import bootstrap_cache_path

        path = bootstrap_cache_path(cfg)
        if not path.exists():
            raise SystemExit(f"the bootstrapped base model is not cached at {path}: run the config once first")
        return str(path)
    return cfg.policy.model_name


def _sample(lm, tok, prompts: list[torch.Tensor], max_new: int, batch: int = 512) -> list[list[int]]:
    """One sampled response (token ids, up to and including EOS) per prompt."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out: list[list[int]] = []
    for s in range(0, len(prompts), batch):
        chunk = prompts[s:s + batch]
        width = max(len(x) for x in chunk)
        ids = torch.full((len(chunk), width), pad)
        att = torch.zeros_like(ids)
        for j, x in enumerate(chunk):  # left-padded: generation continues every row at the same column
            ids[j, width - len(x):], att[j, width - len(x):] = x, 1
        with torch.no_grad():
            gen = lm.generate(input_ids=ids, attention_mask=att, do_sample=True, temperature=1.0, top_k=0,
                              top_p=1.0, max_new_tokens=max_new, pad_token_id=pad, eos_token_id=tok.eos_token_id)
        for row in gen[:, width:].tolist():
            out.append(row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return out


def _grade(tok, responses: list[list[int]], answers: list[str]) -> list[float]:
    return [verify_math_answer(tok.decode(r, skip_special_tokens=True), a) for r, a in zip(responses, answers,
                                                                                            strict=True)]


def _ev(values: torch.Tensor, returns: torch.Tensor) -> float:
    """The critic metric's explained variance over all the given tokens."""
    return explained_variance(values[None], returns[None], torch.ones(1, returns.numel()))  # one row [1, N]


def _fit_critic(folder: str, seqs: list[torch.Tensor], plens: list[int], rewards: list[float], test: int,
                epochs: int, lr: float) -> list[float]:
    """Explained variance on the first ``test`` sequences before training and after each epoch on the rest."""
    n, width = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(n, width, dtype=torch.long)
    lens = torch.tensor([len(s) for s in seqs])
    mask = torch.zeros(n, width)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        mask[i, plens[i]:len(s)] = 1
    ret = torch.tensor(rewards)[:, None] * mask
    model, _ = load_value_model(folder)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def values(rows: torch.Tensor) -> torch.Tensor:
        attn = (torch.arange(width)[None] < lens[rows][:, None]).long()
        return shifted_values(model(input_ids=ids[rows], attention_mask=attn).logits[..., 0], lens[rows])

    def ev() -> float:
        rows = torch.arange(test)
        with torch.no_grad():
            v = values(rows)
        m = mask[rows] > 0
        return _ev(v[m], ret[rows][m])

    out = [ev()]
    train = torch.arange(test, n)
    for _ in range(epochs):
        perm = train[torch.randperm(len(train))]
        for s in range(0, len(perm), 128):
            rows = perm[s:s + 128]
            loss = (0.5 * (values(rows) - ret[rows]) ** 2 * mask[rows]).sum() / mask[rows].sum()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        out.append(ev())
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="examples/configs/ppo_math_tiny.yaml")
    ap.add_argument("--model", default=None, help="policy folder to measure (default: the config's base model)")
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--continuations", type=int, default=16)
    ap.add_argument("--fit-samples", type=int, default=3000)
    ap.add_argument("--fit-epochs", type=int, default=4)
    ap.add_argument("--fit-lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.continuations < 2:
        ap.error("--continuations must be at least 2 (the noise correction divides by K - 1)")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = load_config(args.config)
    folder = _model_folder(cfg, args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = load_dataset_from_config(cfg.data.train_list[0])
    n = args.samples + args.fit_samples
    if n > len(rows):
        raise SystemExit(f"--samples + --fit-samples = {n} is more than the {len(rows)} training problems")
    ds = build_task_dataset(cfg.data.train_list[:1], [rows], tok, cfg.data.max_input_seq_length)
    prompts = [torch.cat([m["token_ids"] for m in ds[i]["message_log"]]) for i in range(n)]
    answers = [str(rows[i]["expected_answer"]) for i in range(n)]
    max_new = cfg.policy.generation.max_new_tokens
    t0 = time.time()
    responses = _sample(lm, tok, prompts, max_new)
    rewards = _grade(tok, responses, answers)

    # V*(s_t) for every response token of the first --samples responses.
    k = args.continuations
    v_hat, ret = [], []
    for i in range(args.samples):
        resp = responses[i]
        prefixes = [torch.cat([prompts[i], torch.tensor(resp[:t], dtype=torch.long)]) for t in range(len(resp))]
        conts = _sample(lm, tok, [p for p in prefixes for _ in range(k)], max_new)
        for t in range(len(resp)):
            tails = [resp[:t] + c for c in conts[t * k:(t + 1) * k]]
            v_hat.append(sum(_grade(tok, tails, [answers[i]] * k)) / k)
            ret.append(rewards[i])
    v, r = torch.tensor(v_hat), torch.tensor(ret)
    noise = float((v * (1 - v) / (k - 1)).mean())
    ceiling = (float(v.var()) - noise) / float(r.var())
    mc_s = time.time() - t0

    print(f"policy: {folder}")
    print(f"work: {args.config} (training problems), temperature 1, max_new_tokens {max_new}")
    print()
    print("| | |")
    print("|---|---|")
    print(f"| responses measured (response tokens) | {args.samples} ({len(r)}) |")
    print(f"| sampled reward mean (all {n} responses) | {sum(rewards) / n:.3f} |")
    print(f"| continuations per token | {k} |")
    print(f"| **ceiling of explained variance**, Var(V*) / Var(R) | **{ceiling:.3f}** |")
    print(f"| explained variance of the Monte Carlo estimate itself | {_ev(v, r):.3f} |")
    print(f"| seconds (sampling and continuations) | {mc_s:.0f} |")
    if args.fit_samples:
        t1 = time.time()
        seqs = [torch.cat([prompts[i], torch.tensor(responses[i], dtype=torch.long)]) for i in range(n)]
        plens = [len(p) for p in prompts]
        curve = _fit_critic(folder, seqs, plens, rewards, args.samples, args.fit_epochs, args.fit_lr)
        print(f"| a fresh critic on {args.fit_samples} other responses, lr {args.fit_lr:g}: explained variance "
              f"before, after each of {args.fit_epochs} epochs | {', '.join(f'{x:.3f}' for x in curve)} |")
        print(f"| seconds (critic fit) | {time.time() - t1:.0f} |")


if __name__ == "__main__":
    main()
