"""The continuous-batching engine gives HF `generate`'s results: the same greedy tokens, lengths and
truncation flags (ragged prompts, GRPO repeats, per-sample budgets, early EOS, stop strings, more
prompts than slots), the same log-probs, and sampled log-probs that a teacher-forced pass recomputes."""

from __future__ import annotations

import copy

import pytest
import torch
from _nl_model_test_helpers import assert_same_generation, chat_prompts

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.generation.engine import ContinuousBatcher, continuous_generate, unsupported_reason
from nemo_like.models.generation.hf_generation import hf_generate
from nemo_like.models.generation.interfaces import GenerationConfig
from nemo_like.models.generation.slots import Slots
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama

CPU = torch.device("cpu")
G = 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls on a busy 2-core machine: a second OpenMP thread waits far more than it computes.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_engine")
    tok = build_char_tokenizer(d)
    model = build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=128, seed=0)
    # Sharper weights: the random init's greedy text is one repeated character; this one varies (real
    # EOS/stop-string positions differ per row) and has no near ties for float noise to flip.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    return tok, model.float().eval()


def _prompts(tok, G: int = G) -> BatchedDataDict:
    return chat_prompts(tok, ["1+2=", "13+45=", "99+1=", "5+60=", "7*7=", "70-8=", "123+456=", "0+0="], G)


def _run(model, tok, data, engine: str, *, greedy=True, max_total=None, slots=5, mbs=7, **cfg_kw):
    cfg = GenerationConfig(engine=engine, max_num_seqs=slots, **({"max_new_tokens": 20} | cfg_kw))
    max_total = max_total or int(data["input_lengths"].max()) + 30
    return hf_generate(model, tok, data, cfg, greedy=greedy, max_total_length=max_total, micro_batch_size=mbs,
                       synced=False, device=CPU)


def _with_eos(tok, model, data):
    """A copy of the tokenizer whose EOS is a token the greedy rows emit a few tokens in, at different
    steps (a random model almost never emits the real one)."""
    plain = _run(model, tok, data, "generate")
    n = data["input_lengths"]
    gen = [plain["output_ids"][i, int(n[i]) : int(n[i]) + 20].tolist() for i in range(len(n))]
    eos_tok = copy.deepcopy(tok)
    eos_tok.eos_token = tok.convert_ids_to_tokens(gen[0][3])
    return eos_tok


def test_greedy_equals_generate_with_ragged_budgets_early_eos_and_slot_reuse(tiny):
    tok, model = tiny
    data = _prompts(tok)
    eos_tok = _with_eos(tok, model, data)
    # The longest prompts get fewer tokens than max_new_tokens: budgets differ per sample.
    max_total = int(data["input_lengths"].max()) + 12
    ref = _run(model, eos_tok, data, "generate", max_total=max_total)
    out = _run(model, eos_tok, data, "continuous", max_total=max_total, slots=5)  # 24 prompts, 5 slots
    assert_same_generation(ref, out)
    lens = out["generation_lengths"]
    assert len(set(lens.tolist())) > 2 and bool((~out["truncated"]).any()) and bool(out["truncated"].any())
    budgets = (max_total - data["input_lengths"]).clamp(max=20)
    assert len(set(budgets.tolist())) > 1 and bool((lens <= budgets).all())
    assert not out["output_ids"].is_inference()  # the training step embeds these ids


@pytest.mark.parametrize("slots", [1, 4, 64])
def test_greedy_equals_generate_for_any_slot_count(tiny, slots, monkeypatch):

    tok, model = tiny
    data = _prompts(tok)
    eos_tok = _with_eos(tok, model, data)
    compactions = []
    compact = Slots.compact
    monkeypatch.setattr(Slots, "compact", lambda self: compactions.append(1) or compact(self))
    assert_same_generation(_run(model, eos_tok, data, "generate"), _run(model, eos_tok, data, "continuous", slots=slots))
    if slots == 4:  # refills kept the columns growing until they were packed
        assert compactions


def test_stop_strings_per_sample(tiny):
    tok, model = tiny
    data = _prompts(tok)
    plain = _run(model, tok, data, "generate")
    n = data["input_lengths"]
    # A stop string the greedy text of sample 4 holds a few tokens in.
    row = plain["output_ids"][4, int(n[4]) : int(n[4]) + 20].tolist()
    stop = tok.decode(row[5:7])
    data_all = BatchedDataDict(dict(data) | {"stop_strings": [[stop, "zzzz"]] * len(n)})
    ref = _run(model, tok, data_all, "generate")
    out = _run(model, tok, data_all, "continuous")
    assert_same_generation(ref, out)
    assert bool((~out["truncated"]).any())
    # Stop strings are per sample: those given none run on as without any (HF applies the union).
    some = [[stop] if i % 2 else None for i in range(len(n))]
    out = _run(model, tok, BatchedDataDict(dict(data) | {"stop_strings": some}), "continuous")
    for i in range(len(n)):
        r = ref if i % 2 else plain
        assert torch.equal(out["generation_lengths"][i], r["generation_lengths"][i])
        w = int(out["unpadded_sequence_lengths"][i])
        assert torch.equal(out["output_ids"][i, :w], r["output_ids"][i, :w])


@pytest.mark.parametrize("sampling", [{}, {"top_k": 5}, {"top_p": 0.7, "temperature": 0.7}])
def test_sampled_logprobs_match_a_teacher_forced_pass(tiny, sampling):
    tok, model = tiny
    data = _prompts(tok, G=4)
    torch.manual_seed(0)
    max_total = int(data["input_lengths"].max()) + 10
    out = _run(model, tok, data, "continuous", greedy=False, max_total=max_total, slots=6, **sampling)
    n, g, ids = data["input_lengths"], out["generation_lengths"], out["output_ids"]
    budgets = (max_total - n).clamp(max=20)
    assert bool((g >= 1).all()) and bool((g <= budgets).all())
    assert torch.equal(out["unpadded_sequence_lengths"], n + g)
    mask = (torch.arange(ids.shape[1])[None] < (n + g)[:, None]).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float() / sampling.get("temperature", 1.0)
    lp = logits[:, :-1].log_softmax(-1).gather(2, ids[:, 1:, None]).squeeze(-1)
    for i in range(len(n)):
        a, b = int(n[i]), int(n[i] + g[i])
        assert torch.allclose(out["logprobs"][i, a:b], lp[i, a - 1 : b - 1], atol=1e-4)
        assert bool((out["logprobs"][i, :a] == 0).all()) and bool((out["logprobs"][i, b:] == 0).all())
        if "top_k" in sampling:  # every token came from the k most likely
            top = logits[i, a - 1 : b - 1].topk(sampling["top_k"], -1).indices
            assert bool((top == ids[i, a:b, None]).any(-1).all())
    g0 = out["output_ids"][:4]  # repeats share a prefill but sample independently
    assert len({tuple(r.tolist()) for r in g0}) > 1


def test_budget_of_one_token(tiny):
    tok, model = tiny
    data = _prompts(tok, G=2)
    max_total = int(data["input_lengths"].max()) + 1  # the longest prompts may add just one token
    out = _run(model, tok, data, "continuous", max_total=max_total)
    assert_same_generation(_run(model, tok, data, "generate", max_total=max_total), out)
    assert 1 in out["generation_lengths"].tolist()


def test_synced_ranks_use_generate(tiny, monkeypatch):
    """FSDP ranks run collectives in every forward: they keep `generate`'s lock step."""
    from nemo_like.models.generation import hf_generation

    tok, model = tiny
    data = _prompts(tok, G=2)

    def refuse(*a, **k):
        raise AssertionError("the continuous engine ran with synced ranks")

    monkeypatch.setattr(hf_generation, "continuous_generate", refuse)
    calls = []
    plain_generate = model.generate

    def generate(**kw):  # no process group here: record the flag, run unsynced
        calls.append(kw.pop("synced_gpus"))
        return plain_generate(**kw)

    monkeypatch.setattr(model, "generate", generate)
    cfg = GenerationConfig(engine="continuous", max_new_tokens=5)
    out = hf_generate(model, tok, data, cfg, greedy=True, max_total_length=80, micro_batch_size=8, synced=True,
                      device=CPU)
    assert calls == [True, True] and out["output_ids"].shape[0] == len(data["input_lengths"])
    ref = continuous_generate(model, tok, data, cfg, greedy=True, max_total_length=80, slots=4, device=CPU)
    assert_same_generation(out, ref)


def test_unsupported_models_are_named():
    from transformers import MistralConfig, MistralForCausalLM

    assert unsupported_reason(torch.nn.Linear(2, 2)) is not None
    cfg = MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, sliding_window=8)
    assert "sliding" in unsupported_reason(MistralForCausalLM(cfg))


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_other_decoder_architectures(tiny, arch):
    """Grouped-query attention with biases (Qwen2), learned absolute positions (GPT-2)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    tok, _ = tiny
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                           bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    model = model.float().eval()
    assert unsupported_reason(model) is None
    data = _prompts(tok, G=2)
    assert_same_generation(_run(model, tok, data, "generate", max_total=60), _run(model, tok, data, "continuous", max_total=60))


def test_requests_added_one_at_a_time_grow_their_buffers_by_doubling(tiny):
    """A stream adds requests in small groups of any width: every request's row holds its own prompt
    (the rest padding), and the buffers are copied once per doubling, not at every addition."""
    tok, model = tiny
    batcher = ContinuousBatcher(model, tok, None, GenerationConfig(max_new_tokens=4), greedy=True,
                                max_total_length=64, slots=4, device=torch.device("cpu"))
    rows, moves, last = [], 0, None
    for n in range(1, 41):
        width = 3 + (n * 7) % 11  # narrower and wider than the rows before
        ids = torch.arange(n, n + width)[None] % 50 + 5
        rows.append(ids[0])
        assert batcher.add(ids, torch.tensor([width]), [None]) == [n - 1]
        ptr = batcher._buf["tokens"].data_ptr()
        moves, last = moves + (ptr != last), ptr
    assert moves <= 7  # capacities 1, 2, 4, ..., 64: log2(40) + 1 copies
    assert batcher.input_ids.shape[0] == batcher.tokens.shape[0] == len(batcher.lengths) == 40
    for i, r in enumerate(rows):
        assert torch.equal(batcher.input_ids[i, : len(r)], r) and int(batcher.lengths[i]) == len(r)
        assert bool((batcher.input_ids[i, len(r):] == batcher.pad_id).all())
        assert torch.equal(batcher.input_dev[i], batcher.input_ids[i])
    batcher.run()
    out = [batcher.result(i)[0] for i in range(40)]
    assert all(1 <= len(t) <= 4 for t in out)


def test_per_request_temperature_top_p_and_budget_log_probs_are_recomputable(tiny):
    """A server's requests with their own temperature, top-p and token budget in one batch: each
    sampled token's log-prob is that of its own temperature-scaled softmax, and no request runs past
    its budget."""
    tok, model = tiny
    data = _prompts(tok, G=1)
    cfg = GenerationConfig(max_new_tokens=12)
    torch.manual_seed(0)
    with torch.inference_mode():
        b = ContinuousBatcher(model, tok, None, cfg, greedy=False, max_total_length=128, slots=4, device=CPU)
        asks = [(0.5, 1.0, 12), (1.7, 0.9, 5), (None, None, 8), (1.0, 0.5, 3)]
        reqs = []
        for i, (t, p, n) in enumerate(asks):
            L = int(data["input_lengths"][i])
            reqs += b.add(data["input_ids"][i:i + 1, :L], data["input_lengths"][i:i + 1], [None],
                          temperature=t, top_p=p, max_new_tokens=n)
        b.run(_Everything())
    for (t, _, n), r in zip(asks, reqs):
        toks, lps, _ = b.result(r)
        assert 1 <= len(toks) <= n
        L = int(data["input_lengths"][r])
        ids = torch.cat([data["input_ids"][r, :L], toks])[None]
        with torch.no_grad():
            logits = model(ids).logits[0, L - 1:-1].float() / (t or 1.0)
        want = logits.log_softmax(-1).gather(1, toks[:, None]).squeeze(1)
        assert torch.allclose(lps, want, atol=1e-4)


class _Everything:
    """A request source with nothing more to add: the batcher decodes what it was given."""

    def poll(self, batcher, block):
        return None

    def finished(self, batcher, requests):
        return None

    def exhausted(self):
        return True


def test_a_stream_of_ever_longer_prompts_grows_the_buffers_by_width_not_by_doubling_rows(tiny):
    """Each later turn of an episode is longer than any prompt before it: the per-request buffers
    widen, and their rows still double only when they run out (they once doubled at every widening:
    65,536 rows for 128 requests, and 256 concurrent chat sessions ran out of 24 GB)."""
    tok, model = tiny
    b = ContinuousBatcher(model, tok, None, GenerationConfig(max_new_tokens=4), greedy=True, max_total_length=128,
                          slots=4, device=CPU)
    for n in range(1, 101):
        b.add(torch.ones((1, n), dtype=torch.long), torch.tensor([n]), [None])
    assert b._buf["input_ids"].shape == (128, 100) and b.input_ids.shape == (100, 100)
    assert b._buf["tokens"].shape[0] == 128
