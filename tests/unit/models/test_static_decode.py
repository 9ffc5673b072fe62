"""Fixed-shape decode steps (`policy.generation.decode_mode`: static, compiled, graphs) give the dynamic
step's results: the same greedy tokens, lengths and truncation through slot reuse, early EOS, stop
strings, compaction and growth of the cache, cached prefixes, and sampled log-probs that a
teacher-forced pass recomputes. Compiled steps keep their traces across calls of other batch sizes."""

from __future__ import annotations

import copy

import pytest
import torch
from _nl_model_test_helpers import assert_same_generation, chat_prompts

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.generation import static_decode
from nemo_like.models.generation.engine import continuous_generate
from nemo_like.models.generation.interfaces import GenerationConfig
from nemo_like.models.generation.prefix_cache import PrefixCache
from nemo_like.models.generation.slots import Slots
from nemo_like.models.generation.static_decode import StaticDecoder, bucket, row_buckets, static_decoder
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama

CPU = torch.device("cpu")
TEXTS = ["1+2=", "13+45=", "99+1=", "5+60=", "7*7=", "70-8=", "123+456=", "0+0="]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread waits more than it computes
    yield
    torch.set_num_threads(n)


def _model(tok, seed=0):
    model = build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=256, seed=seed)
    with torch.no_grad():  # sharper weights: varied greedy text, no near ties (as in test_engine)
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    return model.float().eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tok = build_char_tokenizer(tmp_path_factory.mktemp("tiny_static"))
    model = _model(tok)
    # An EOS the greedy rows emit a few tokens in, at different steps (a random model almost never
    # emits the real one), so rows end at different steps and slots are reused.
    data = chat_prompts(tok, TEXTS, 3)
    out = _gen(model, tok, data, "dynamic")
    n = int(data["input_lengths"][0])
    eos_tok = copy.deepcopy(tok)
    eos_tok.eos_token = tok.convert_ids_to_tokens(int(out["output_ids"][0, n + 3]))
    return eos_tok, model, data


def _gen(model, tok, data, mode, *, slots=5, greedy=True, max_total=None, cache=None, **cfg):
    cfg = GenerationConfig(max_new_tokens=20, decode_mode=mode, **cfg)
    max_total = max_total or int(data["input_lengths"].max()) + 30
    return continuous_generate(model, tok, data, cfg, greedy=greedy, max_total_length=max_total, slots=slots,
                               device=CPU, prefix_cache=cache)


def test_buckets_are_powers_of_two_up_to_the_slots():
    assert row_buckets(1) == [1] and row_buckets(5) == [1, 2, 4, 5] and row_buckets(8) == [1, 2, 4, 8]
    assert row_buckets(256)[-2:] == [128, 256] and len(row_buckets(256)) == 9
    assert [bucket(n, row_buckets(48)) for n in (1, 3, 17, 33, 48)] == [1, 4, 32, 48, 48]


@pytest.mark.parametrize("slots", [1, 4, 64])
def test_static_steps_give_the_dynamic_steps_tokens(tiny, slots):
    tok, model, data = tiny
    ref = _gen(model, tok, data, "dynamic", slots=slots)
    out = _gen(model, tok, data, "static", slots=slots)
    assert_same_generation(ref, out)
    assert bool((~out["truncated"]).any()) and bool(out["truncated"].any())  # some ended by EOS, some did not
    d = static_decoder(model, "static")
    B = d._buffers[0][0].shape[0]
    assert B >= min(slots, len(data["input_lengths"])) and {b for b, _ in d.shapes} <= set(row_buckets(B))


def test_compaction_and_growth_of_a_kept_cache(tiny, monkeypatch):
    """Columns rounded to 16, not 256: refills run the columns out (packed to the front), and the
    longer second batch needs more than the kept buffers hold (grown, its tokens moved with it)."""
    tok, model, data = tiny
    monkeypatch.setattr(static_decode, "COLUMN_STEP", 16)
    static_decode._DECODERS.pop(model, None)
    packed = []
    compact = Slots.compact
    monkeypatch.setattr(Slots, "compact", lambda self: packed.append(1) or compact(self))
    ragged = int(data["input_lengths"].max()) + 12  # budgets differ by prompt: rows end at different steps
    assert_same_generation(_gen(model, tok, data, "dynamic", slots=4, max_total=ragged),
                 _gen(model, tok, data, "static", slots=4, max_total=ragged))
    assert packed
    long = chat_prompts(tok, [t * 6 for t in TEXTS[:4]], 2)
    before = static_decoder(model, "static")._buffers[0][0].shape[2]
    assert_same_generation(_gen(model, tok, long, "dynamic", slots=3, max_total=200),
                 _gen(model, tok, long, "static", slots=3, max_total=200))
    assert static_decoder(model, "static")._buffers[0][0].shape[2] > before
    static_decode._DECODERS.pop(model, None)


def test_stop_strings_and_cached_prefixes(tiny):
    tok, model, data = tiny
    n = data["input_lengths"]
    plain = _gen(model, tok, data, "dynamic")
    stop = tok.decode(plain["output_ids"][4, int(n[4]) + 5: int(n[4]) + 7].tolist())
    stopped = BatchedDataDict(dict(data) | {"stop_strings": [[stop] if i % 2 else None for i in range(len(n))]})
    assert_same_generation(_gen(model, tok, stopped, "dynamic"), _gen(model, tok, stopped, "static"))
    # Next turns prefilled on top of the first turns' KV, decoded in fixed shapes.
    first = chat_prompts(tok, TEXTS[:6], 1)
    cache = PrefixCache(max_tokens=10_000)
    out1 = _gen(model, tok, first, "static", cache=cache)
    rows = [torch.cat([out1["output_ids"][i, : int(out1["unpadded_sequence_lengths"][i])],
                       torch.tensor(tok("\n<|im_start|>user\nok<|im_end|>\n", add_special_tokens=False)["input_ids"])])
            for i in range(6)]
    nxt = BatchedDataDict(input_ids=torch.nn.utils.rnn.pad_sequence(rows, batch_first=True,
                                                                      padding_value=tok.pad_token_id),
                          input_lengths=torch.tensor([len(r) for r in rows]))
    got = _gen(model, tok, nxt, "static", cache=cache, max_total=200)
    assert cache.hits == 6
    assert_same_generation(_gen(model, tok, nxt, "dynamic", max_total=200), got)


class _NextTurns:
    """A request source as a server's is: each finished request's tokens plus a user turn come back as
    a new request (up to ``turns`` per episode), longer than any before (the columns must grow)."""

    def __init__(self, tok, turns: int):
        self.tok, self.turns, self.queue, self.depth, self.done = tok, turns, [], {}, []
        self.suffix = tok("<|im_end|>\n<|im_start|>user\nmore please<|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False)["input_ids"]

    def poll(self, batcher, block):
        for ids, depth in self.queue:
            [r] = batcher.add(torch.tensor([ids]), torch.tensor([len(ids)]), [None])
            self.depth[r] = depth
        self.queue = []

    def finished(self, batcher, requests):
        for r in requests:
            toks, _, _ = batcher.result(r)
            self.done.append((r, toks.tolist()))
            if self.depth.get(r, 0) + 1 < self.turns:
                n = int(batcher.lengths[r])
                self.queue.append((batcher.input_ids[r, :n].tolist() + toks.tolist() + self.suffix,
                                   self.depth.get(r, 0) + 1))

    def exhausted(self):
        return not self.queue


def test_a_stream_of_next_turns_decodes_as_the_dynamic_step_does(tiny, monkeypatch):
    """The server's and the streamed episodes' batcher (requests arriving while others decode, prompts
    growing turn by turn): the same tokens with fixed-shape steps, the kept cache grown on the way
    (columns in steps of 16 here)."""
    from nemo_like.models.generation.engine import ContinuousBatcher

    tok, model, data = tiny
    monkeypatch.setattr(static_decode, "COLUMN_STEP", 16)
    static_decode._DECODERS.pop(model, None)
    grown = []
    grow = Slots.grow
    monkeypatch.setattr(Slots, "grow", lambda self, c: grown.append(self.storage is not None) or grow(self, c))
    got = {}
    for mode in ("dynamic", "static"):
        source = _NextTurns(tok, turns=3)
        with torch.inference_mode():
            b = ContinuousBatcher(model, tok, None, GenerationConfig(max_new_tokens=12, decode_mode=mode),
                                  greedy=True, max_total_length=250, slots=4, device=CPU)
            for i in range(6):
                n = int(data["input_lengths"][i])
                source.queue.append((data["input_ids"][i, :n].tolist(), 0))
            b.run(source)
        got[mode] = sorted(source.done)
    assert len(got["static"]) == 18 and got["static"] == got["dynamic"]
    assert True in grown  # the kept buffers were outgrown by a later turn, and replaced
    static_decode._DECODERS.pop(model, None)


def test_sampled_logprobs_match_a_teacher_forced_pass(tiny):
    tok, model, data = tiny
    torch.manual_seed(0)
    out = _gen(model, tok, data, "static", greedy=False, slots=6, top_p=0.8, temperature=0.7)
    n, g, ids = data["input_lengths"], out["generation_lengths"], out["output_ids"]
    assert len(set(g.tolist())) > 1
    for i in range(len(n)):
        a, b = int(n[i]), int(n[i] + g[i])
        with torch.no_grad():
            logits = model(ids[i: i + 1, :b]).logits[0, a - 1: b - 1] / 0.7
        want = logits.log_softmax(-1).gather(1, ids[i, a:b, None]).squeeze(1)
        torch.testing.assert_close(out["logprobs"][i, a:b], want, atol=1e-4, rtol=0)


def test_eager_attention_takes_the_mask_and_others_are_refused(tiny, tmp_path):
    tok, model, data = tiny
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    assert_same_generation(_gen(model, tok, data, "dynamic"), _gen(eager, tok, data, "static"))
    other = copy.deepcopy(model)
    other.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="decode_mode='static' needs attention that takes a 4-D mask.*"
                                         "'flash_attention_2'.*decode_mode: dynamic"):
        StaticDecoder(other, "static")
    with pytest.raises(ValueError, match="decode_mode"):
        GenerationConfig(decode_mode="cuda")


def test_a_second_engine_decoding_at_once_gets_buffers_of_its_own(tiny):
    tok, model, _ = tiny
    d = StaticDecoder(model, "static")
    like = [torch.zeros(1, 2, 3, 16)] * 2

    class Owner:  # a Slots as the decoder sees it: how many rows it decodes now
        n = 0

    a, b = Owner(), Owner()
    first = d.cache_for(like, 4, 10, a)
    assert first.layers[0].keys_buf.shape == (4, 2, static_decode.COLUMN_STEP, 16)
    a.n = 3
    other = d.cache_for(like, 4, 10, b)  # a is decoding in the kept buffers
    assert other is not first and other.layers[0].keys_buf.data_ptr() != first.layers[0].keys_buf.data_ptr()
    a.n = 0
    assert d.cache_for(like, 2, 10, b) is first  # a is idle: lent to b (large enough)
    del a
    bigger = d.cache_for(like, 8, 10, b)
    assert bigger is not first and bigger.layers[0].keys_buf.shape[0] == 8


def test_an_idle_engine_lends_its_kept_cache_and_takes_it_back(tiny):
    """A server's batcher stays alive between requests; a generate call meanwhile uses the model's kept
    buffers (not new ones a compiled step would retrace for), and the idle batcher, admitting again,
    takes them back; both decode as the dynamic step does."""
    from nemo_like.models.generation.engine import ContinuousBatcher

    tok, model, data = tiny
    static_decode._DECODERS.pop(model, None)
    cfg = GenerationConfig(max_new_tokens=12, decode_mode="static")

    def ask(b, i):
        n = int(data["input_lengths"][i])
        [r] = b.add(data["input_ids"][i:i + 1, :n], torch.tensor([n]), [None])
        b.run()
        return b.result(r)[0].tolist()

    with torch.inference_mode():
        idle = ContinuousBatcher(model, tok, None, cfg, greedy=True, max_total_length=200, slots=8, device=CPU)
        first = ask(idle, 0)
        kept = static_decoder(model, "static")._buffers
        out = _gen(model, tok, data, "static", slots=8)
        assert static_decoder(model, "static")._buffers is kept  # lent, not a second set
        again = ask(idle, 3)
        assert idle.slots_state.cache.layers[0].keys_buf is kept[0][0]
    ref = _gen(model, tok, data, "dynamic", slots=8)
    assert_same_generation(ref, out)
    n0, n3 = int(data["input_lengths"][0]), int(data["input_lengths"][3])
    assert first == ref["output_ids"][0, n0:n0 + len(first)].tolist()
    assert again == ref["output_ids"][3, n3:n3 + len(again)].tolist()


def test_a_private_cache_grows_into_the_larger_kept_one(tiny):
    """An engine that got buffers of its own (another was decoding in the kept ones) and outgrows them
    once that one is idle: it moves into new kept buffers with more rows than its own, tokens and all."""
    from types import SimpleNamespace

    _, model, _ = tiny
    d = StaticDecoder(model, "static")
    prefill = SimpleNamespace(layers=[SimpleNamespace(keys=torch.zeros(1, 2, 3, 16)) for _ in range(2)])
    big = Slots(model, 8, 10, prefill, CPU, storage=d)
    big.n = 2  # decoding
    small = Slots(model, 2, 10, prefill, CPU, storage=d)
    assert small.cache is not big.cache and small.valid.shape == (2, static_decode.COLUMN_STEP)
    small.cache.layers[1].values_buf[:, :, :3] = 7.0
    small.valid[:, :3], small.pos[:], small.length, small.n = True, torch.tensor([3, 2]), 3, 2
    big.n = 0  # idle now
    small.grow(static_decode.COLUMN_STEP + 1)
    buf = small.cache.layers[1].values_buf
    assert buf.shape == (8, 2, 2 * static_decode.COLUMN_STEP, 16) and d._buffers[1][1] is buf
    assert bool((buf[:2, :, :3] == 7).all()) and small.valid.shape == (8, 2 * static_decode.COLUMN_STEP)
    assert bool(small.valid[:2, :3].all()) and not bool(small.valid[2:].any())
    assert small.pos.tolist() == [3, 2, 0, 0, 0, 0, 0, 0] and small.req.shape == small.last.shape == (8,)


def test_the_decoders_do_not_keep_their_models_alive(tmp_path):
    import gc
    import weakref

    tok = build_char_tokenizer(tmp_path)
    model = _model(tok, seed=2)
    _gen(model, tok, chat_prompts(tok, TEXTS[:2], 2), "static")
    assert static_decode._DECODERS.get(model) is not None
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_compiled_steps_equal_eager_ones_and_keep_their_traces_across_calls(tmp_path):
    """torch.compile of the step (inductor on a CPU): the greedy tokens of the eager fixed-shape step,
    and a training-sized batch, a validation-sized one and a sampled one add at most one trace (the
    first shape's, then one with dynamic sizes), not one per call or per step."""
    from torch._dynamo.utils import counters

    tok = build_char_tokenizer(tmp_path)
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=256, seed=1)
    model.float().eval()
    data = chat_prompts(tok, TEXTS[:4], 2)
    ref = _gen(model, tok, data, "static", slots=8)
    before = counters["stats"]["unique_graphs"]
    assert_same_generation(ref, _gen(model, tok, data, "compiled", slots=8))
    _gen(model, tok, chat_prompts(tok, TEXTS[:3], 1), "compiled", slots=3)
    torch.manual_seed(0)
    _gen(model, tok, data, "compiled", slots=8, greedy=False)
    assert_same_generation(ref, _gen(model, tok, data, "compiled", slots=8))
    assert 1 <= counters["stats"]["unique_graphs"] - before <= 2
    d = static_decoder(model, "compiled")
    assert d.steps > 40 and len(d.shapes) >= 2
