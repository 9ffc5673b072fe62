"""Continuous batching over a HF causal LM's forward with a KV cache (`policy.generation.engine`).

HF `generate` runs a micro-batch until its longest sample ends: finished rows keep being computed, and
every step pays for logits processors, stopping criteria and stop-string checks in Python. Here a
fixed number of slots decode together; a sample that ends (EOS, stop string, its own token budget)
leaves the batch at once and the next waiting prompts are prefilled and merged in.

The cache (`slots.Slots`) is preallocated: per layer [slots, heads, columns, dim], behind a `DynamicCache`
whose layers write in place (`DynamicLayer` concatenates, copying the whole cache every step). All rows
write the same column each step; a `valid` mask says which columns hold each row's real tokens, and
positions are explicit (real tokens so far), so where a row's tokens sit never shifts its positions. A
finished row is replaced by the last live row (a copy of one row); new prompts are prefilled on their
own (each distinct prompt once, its cache rows copied to its repeats: GRPO repeats every prompt G
times) and written into free rows, ending at the current column. When the columns run out, each row's
tokens are packed to the front.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Protocol

import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.generation.interfaces import GenerationConfig
from nemo_like.models.generation.prefix_cache import PrefixCache, cached_prefill_inputs
from nemo_like.models.generation.sampling import sample as _sample
from nemo_like.models.generation.sampling import sample_rows as _sample_rows
from nemo_like.models.generation.slots import Slots
from nemo_like.models.generation.static_decode import static_decoder

# New prompts are admitted once this fraction of the slots is free (or the queue fits): each admission
# costs one prefill forward and one copy of the whole cache, so admitting one prompt per freed slot
# would cost more than the idle slots it fills.
REFILL_FRACTION = 0.25


def token_budgets(lengths: torch.Tensor, cfg: GenerationConfig, max_total_length: int) -> torch.Tensor:
    """Each sample's own limit, min(max_new_tokens, max_total_length - its prompt length).

    A batch's longest prompt (in multi-turn rollouts, often one sample's long tool response) must not
    cut every other sample's answer short."""
    budgets = (max_total_length - lengths).clamp(max=cfg.max_new_tokens)
    if lengths.numel() and int(budgets.min()) <= 0:
        raise ValueError(
            f"prompt of {int(lengths.max())} tokens leaves no room to generate within "
            f"policy.max_total_sequence_length={max_total_length}"
        )
    return budgets


def position_limit(model) -> int | None:
    """How many positions a model with learned absolute positions has (a row must not run past its
    table); None for rotary ones, which compute positions on the fly."""
    mc = getattr(model, "config", None)
    rotary = mc is None or hasattr(mc, "rope_parameters") or hasattr(mc, "rope_theta")
    return None if rotary else getattr(mc, "max_position_embeddings", None)


# model -> why the engine cannot drive it (or None): checked once per model, not per generate call.
_UNSUPPORTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def unsupported_reason(model) -> str | None:
    """Why the engine cannot drive this model (the caller then uses HF `generate`), or None."""
    if model not in _UNSUPPORTED:
        _UNSUPPORTED[model] = _unsupported_reason(model)
    return _UNSUPPORTED[model]


def _unsupported_reason(model) -> str | None:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return "not a decoder-only transformers model"
    try:
        params = inspect.signature(_base(model).forward).parameters
    except (TypeError, ValueError):
        return "its forward has no inspectable signature"
    if not {"position_ids", "past_key_values", "attention_mask"} <= set(params):
        return "its forward takes no position_ids/past_key_values/attention_mask"
    try:
        layers = DynamicCache(config=config).layers
    except Exception as e:  # noqa: BLE001 - any failure here only means "not supported"
        return f"no DynamicCache for its config ({e})"
    # Sliding-window and recurrent layers keep their own state; rows of those cannot be padded/merged.
    if any(type(layer) is not DynamicLayer for layer in layers):
        return "its cache has sliding-window or recurrent layers"
    return None


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


_TOKEN_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stop_candidates(tokenizer, stops: set[str], vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] bool: tokens that can complete a stop string.

    The text of a prefix grows by the new token's text, so a stop string that first appears when token
    t is added overlaps t's text at its end, and t's text holds the stop string's last character. Only
    rows whose new token passes this lookup are decoded (a short tail window). Tokens whose lone text is
    not their text in context (partial UTF-8 bytes, empty texts) always pass, and so does every token
    when a stop string ends in whitespace (decoders may strip a lone token's leading space)."""
    texts = _TOKEN_TEXTS.get(tokenizer)
    if texts is None:
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
        _TOKEN_TEXTS[tokenizer] = texts
    last = {s[-1] for s in stops if s}
    table = torch.ones(max(vocab, len(texts)), dtype=torch.bool)
    if not any(c.isspace() for c in last):
        table[: len(texts)] = torch.tensor(
            [t == "" or "\ufffd" in t or any(c in t for c in last) for t in texts], dtype=torch.bool
        )
    return table.to(device)


def _append(buf: torch.Tensor, used: int, rows: torch.Tensor, fill: int) -> torch.Tensor:
    """``buf`` with ``rows`` written after its first ``used`` rows (a 2-D buffer as wide as the widest
    rows, the rest ``fill``). Spare rows take later appends: the buffer doubles when full, so a
    stream's many small additions cost one copy per doubling, not one of everything per addition."""
    need = used + rows.shape[0]
    width = tuple(max(a, b) for a, b in zip(buf.shape[1:], rows.shape[1:]))
    if need > buf.shape[0] or width != tuple(buf.shape[1:]):
        # Rows double only when they run out: a wider row alone (a longer prompt) keeps the row count,
        # else a stream whose prompts keep growing doubles the buffer at every one of them.
        n = buf.shape[0] if need <= buf.shape[0] else max(need, 2 * buf.shape[0])
        grown = torch.full((n, *width), fill, dtype=buf.dtype, device=buf.device)
        grown[(slice(0, used), *(slice(0, w) for w in buf.shape[1:]))] = buf[:used]
        buf = grown
    buf[(slice(used, need), *(slice(0, w) for w in rows.shape[1:]))] = rows
    return buf


class RequestSource(Protocol):
    """What feeds a streaming `ContinuousBatcher.run`: requests that arrive while others decode (the
    next turns of multi-turn episodes, once their environment answers)."""

    def poll(self, batcher: ContinuousBatcher, block: bool) -> None:
        """Add the requests ready now with ``batcher.add``; ``block``: nothing is decoding, so wait
        until at least one is ready or none will ever come."""

    def finished(self, batcher: ContinuousBatcher, requests: list[int]) -> None:
        """These requests have ended (their tokens: ``batcher.result(r)``)."""

    def exhausted(self) -> bool:
        """No request will come any more."""


class ContinuousBatcher:
    """One `generate` call's requests (or a `RequestSource`'s), decoded over `slots` rows of a shared
    cache. Per-request storage (prompt, budget, tokens, log-probs) grows as requests are added."""

    def __init__(self, model, tokenizer, data: BatchedDataDict | None, cfg: GenerationConfig, *, greedy: bool,
                 max_total_length: int, slots: int, device: torch.device, prefix_cache: PrefixCache | None = None):
        from transformers import DynamicCache

        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            prefix_cache.sync(model)

        self._new_cache = lambda: DynamicCache(config=model.config)
        self.model, self.cfg, self.greedy, self.device = model, cfg, greedy, device
        self.tokenizer, self.max_total_length = tokenizer, max_total_length
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else -1
        self.pos_limit = position_limit(model)
        fwd = inspect.signature(_base(model).forward).parameters
        self.keep_last = {"logits_to_keep": 1} if "logits_to_keep" in fwd else {}
        self.static = static_decoder(model, cfg.decode_mode)  # None: each step the shape of its live rows
        self.slots_state: Slots | None = None
        self.count = 0  # requests added
        self.pending: list[int] = []  # added, not yet prefilled
        self.stops: list[tuple[str, ...]] = []
        self._all_stops: set[str] = set()
        self.candidates, self.window = None, 0
        self._just_finished: list[torch.Tensor] = []
        self._modes: set[bool] = set()  # greedy and/or sampled requests so far (a shared engine mixes them)
        self._track = False  # a source wants to hear of finished requests
        self._per_row = False  # some request asked for its own temperature or top-p
        if data is None:  # streaming: requests of any length up to the sequence limit come later
            B = 0
            self.max_budget = max(1, min(cfg.max_new_tokens, max_total_length - 1))
            self.slots = max(1, slots)
            self.columns = 16  # grown to what admitted rows need
            ids, lengths, per = torch.zeros((0, 1), dtype=torch.long), torch.zeros(0, dtype=torch.long), []
        else:
            ids, lengths = data["input_ids"], data["input_lengths"].long()
            B = ids.shape[0]
            per = list(data["stop_strings"]) if "stop_strings" in data else [None] * B
            budgets = token_budgets(lengths, cfg, max_total_length)
            self.max_budget = int(budgets.max()) if B else 0
            self.slots = max(1, min(slots, B))
            # Room for the longest sample, and a quarter of a budget more: refills push the columns on,
            # and packing them (one copy of the cache) every budget/4 steps costs little next to the steps.
            longest = int(lengths.max()) + self.max_budget if B else 1
            self.columns = longest + max(self.max_budget // 4, 16)
        # Per request (each attribute is a view of the first `count` rows of a buffer in `_buf` that
        # grows by doubling): prompt ids (CPU and device), lengths, token budgets; the generated
        # tokens and log-probs, written at (request, step) as rows advance; how many so far; whether
        # the request ended by EOS or a stop string; whether it has stop strings.
        self._buf = {"input_ids": ids[:0].long().cpu(), "input_dev": ids[:0].long().to(device),
                     "lengths": torch.zeros(0, dtype=torch.long),
                     "budgets": torch.zeros(0, dtype=torch.long, device=device),
                     "tokens": torch.full((0, self.max_budget), self.pad_id, dtype=torch.long, device=device),
                     "logprobs": torch.zeros((0, self.max_budget), dtype=torch.float32, device=device),
                     "gen_len": torch.zeros(0, dtype=torch.long, device=device),
                     "ended": torch.zeros(0, dtype=torch.bool, device=device),
                     "has_stop": torch.zeros(0, dtype=torch.bool, device=device),
                     "greedy_req": torch.zeros(0, dtype=torch.bool, device=device),
                     "temp": torch.zeros(0, dtype=torch.float32, device=device),
                     "topp": torch.zeros(0, dtype=torch.float32, device=device)}
        for name, buf in self._buf.items():
            setattr(self, name, buf)
        self.arange = torch.arange(max(self.columns, B, max_total_length) + 1, device=device)
        if B:
            self.add(ids, lengths, per)

    def add(self, input_ids: torch.Tensor, lengths: torch.Tensor, stop_strings: list,
            greedy: bool | None = None, *, temperature: float | None = None, top_p: float | None = None,
            max_new_tokens: int | None = None) -> list[int]:
        """Queue requests ([k, T] right padded, [k] lengths, k stop-string lists or None), decoded
        greedily or sampled as ``greedy`` says (None: as the batcher was made); their ids.
        ``temperature``, ``top_p``, ``max_new_tokens``: these requests' own (None: the config's)."""
        k = len(lengths)
        greedy = self.greedy if greedy is None else bool(greedy)
        self._modes.add(greedy)
        temp = self.cfg.temperature if temperature is None else float(temperature)
        topp = self.cfg.top_p if top_p is None else float(top_p)
        self._per_row |= (temp, topp) != (self.cfg.temperature, self.cfg.top_p)
        lengths = lengths.long().cpu()
        budgets = token_budgets(lengths, self.cfg, self.max_total_length).clamp(max=self.max_budget)
        if max_new_tokens is not None:
            budgets = budgets.clamp(max=max(1, int(max_new_tokens)))
        if self.pos_limit is not None:  # learned absolute positions: a row may not run past the table
            budgets = torch.minimum(budgets, (self.pos_limit - lengths).clamp(min=1))
        dev = self.device
        common = set(self.cfg.stop_strings or [])
        stops = [tuple(sorted(set(s or []) | common)) for s in stop_strings]
        self.stops += stops
        new = {"input_ids": input_ids.long().cpu(), "input_dev": input_ids.long().to(dev), "lengths": lengths,
               "budgets": budgets.to(dev),
               "tokens": torch.full((k, self.max_budget), self.pad_id, dtype=torch.long, device=dev),
               "logprobs": torch.zeros((k, self.max_budget), device=dev),
               "gen_len": torch.zeros(k, dtype=torch.long, device=dev),
               "ended": torch.zeros(k, dtype=torch.bool, device=dev),
               "has_stop": torch.tensor([bool(s) for s in stops], dtype=torch.bool, device=dev),
               "greedy_req": torch.full((k,), greedy, dtype=torch.bool, device=dev),
               "temp": torch.full((k,), temp, dtype=torch.float32, device=dev),
               "topp": torch.full((k,), topp, dtype=torch.float32, device=dev)}
        for name, rows in new.items():
            fill = self.pad_id if name in ("input_ids", "input_dev", "tokens") else 0
            self._buf[name] = _append(self._buf[name], self.count, rows, fill)
            setattr(self, name, self._buf[name][: self.count + k])
        if new := {s for ss in stops for s in ss} - self._all_stops:
            self._all_stops |= new
            vocab = int(getattr(self.model.config, "vocab_size", 0) or 0)
            self.candidates = _stop_candidates(self.tokenizer, self._all_stops, vocab, dev)
            # A stop string of c characters spans at most 4c tokens (a byte-level token can hold a
            # quarter of a UTF-8 character); one more for a token that ends past it.
            self.window = 4 * max(len(s) for s in self._all_stops) + 1
        ids = list(range(self.count, self.count + k))
        self.count += k
        self.pending += ids
        return ids

    def result(self, req: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """A request's generated tokens, their log-probs (CPU), and whether it ended by EOS or a stop
        string (else it hit its token budget)."""
        n = int(self.gen_len[req])
        # Copies, not views: a view would keep (and pickle) the whole per-request buffer.
        return self.tokens[req, :n].cpu().clone(), self.logprobs[req, :n].cpu().clone(), bool(self.ended[req])

    # ---- the loop -----------------------------------------------------------------------------
    def run(self, source: RequestSource | None = None) -> BatchedDataDict | None:
        """Decode until every request has ended (and, with a ``source``, until it is exhausted).
        Without a source, the outputs of `generate`'s contract."""
        self._track = source is not None
        while True:
            if source is not None:
                source.poll(self, block=False)
            n = self.slots_state.n if self.slots_state is not None else 0
            free = self.slots - n
            waiting = len(self.pending)
            if waiting and free >= min(waiting, max(1, int(self.slots * REFILL_FRACTION))):
                take, self.pending = self.pending[:free], self.pending[free:]
                self._prefill(torch.tensor(take, device=self.device))
            elif n:
                self._decode(self.slots_state)
            elif source is None or source.exhausted():
                break
            else:
                source.poll(self, block=True)
                continue
            if source is not None and self._just_finished:
                done = torch.cat(self._just_finished).tolist()
                self._just_finished = []
                source.finished(self, done)
        return None if source is not None else self._outputs()

    def _record(self, req: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        """Store each row's new token; which rows ended with it."""
        step = self.gen_len[req]
        self.tokens[req, step] = tok
        self.logprobs[req, step] = lp
        step = step + 1
        self.gen_len[req] = step
        ended = tok == self.eos_id
        if self.candidates is not None:
            ended |= self._stopped(req, tok, step)
        self.ended[req] = ended
        done = ended | (step >= self.budgets[req])
        if self._track:
            self._just_finished.append(req[done])
        return done

    def _stopped(self, req: torch.Tensor, tok: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """Rows whose generated text now holds one of their stop strings (only candidate rows are
        decoded, and only their last `window` tokens)."""
        out = torch.zeros_like(tok, dtype=torch.bool)
        check = (self.candidates[tok] & self.has_stop[req]).nonzero().squeeze(1).tolist()
        for r in check:
            i, n = int(req[r]), int(step[r])
            text = self.tokenizer.decode(self.tokens[i, max(0, n - self.window) : n].tolist(),
                                         skip_special_tokens=False)
            out[r] = any(s in text for s in self.stops[i])
        return out

    def _forward(self, cache, ids: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         past_key_values=cache, use_cache=True, **self.keep_last)
        return out.logits[:, -1]

    def _prefill(self, req: torch.Tensor) -> None:
        """Encode the requests' prompts (each distinct one once; on top of a cached prefix where the
        prefix cache holds one), sample their first tokens, and admit the rows that go on."""
        if self.prefix_cache is not None:
            req = self._prefill_cached(req)
            if not len(req):
                return
        lens = self.lengths[req.cpu()].to(self.device)
        width = int(lens.max())
        # Left padded: row r holds its prompt in its last lens[r] columns.
        pad = width - lens
        col = self.arange[:width][None] - pad[:, None]
        src = self.input_dev[req]
        ids = torch.where(col >= 0, src.gather(1, col.clamp(min=0)), self.pad_id)
        if self.cfg.share_prompt_prefill:
            uniq, inv = torch.unique(torch.cat([ids, pad[:, None]], 1), dim=0, return_inverse=True)
            u_ids, u_pad = uniq[:, :-1], uniq[:, -1]
        else:
            u_ids, u_pad, inv = ids, pad, torch.arange(len(req), device=self.device)
        u_mask = self.arange[:width][None] >= u_pad[:, None]
        pos = (self.arange[:width][None] - u_pad[:, None]).clamp(min=0)
        cache = self._new_cache()
        logits = self._forward(cache, u_ids, pos, u_mask.long() if int(u_pad.max()) else None)
        # Row r's cache is its distinct prompt's (unique sorts): GRPO's repeats copy rows, not work.
        self._admit(req, lens, logits[inv], cache, u_mask, inv)

    def _prefill_cached(self, req: torch.Tensor) -> torch.Tensor:
        """Prefill the requests whose prompt starts with a cached prefix on top of it; the others'."""
        hits, rest = [], []
        for q in req.tolist():
            n = int(self.lengths[q])
            hit = self.prefix_cache.take(self.input_ids[q, :n].tolist())
            (hits if hit else rest).append((q, hit))
        if hits:
            q = torch.tensor([h[0] for h in hits], device=self.device)
            cached = torch.tensor([h[1][0] for h in hits])
            suffixes = [self.input_dev[i, c:int(self.lengths[i])] for (i, _), c in zip(hits, cached.tolist())]
            cache, ids, pos, mask = cached_prefill_inputs(self._new_cache, [h[1][1] for h in hits], cached, suffixes,
                                                          self.pad_id, self.device)
            logits = self._forward(cache, ids, pos, mask.long())
            self._admit(q, self.lengths[q.cpu()].to(self.device), logits, cache, mask,
                        torch.arange(len(hits), device=self.device))
        return torch.tensor([r[0] for r in rest], dtype=torch.long, device=self.device)

    def _admit(self, req: torch.Tensor, lens: torch.Tensor, logits: torch.Tensor, cache, mask: torch.Tensor,
               rows: torch.Tensor) -> None:
        """Sample the first tokens (``logits`` [k, V]) and admit the requests that go on: request j's
        cache is row ``rows[j]`` of ``cache`` (columns where ``mask[rows[j]]`` is set)."""
        tok, lp = self._pick(logits, req)
        go_on = ~self._record(req, tok, lp)
        if not bool(go_on.any()):
            return
        # A row needs a column for each of its tokens but the last sampled one (compaction packs them).
        need = max(int((lens + self.budgets[req])[go_on].max()), mask.shape[1])
        if self.slots_state is None:
            self.columns = max(self.columns, need + max(self.max_budget // 4, 16))
            self.slots_state = Slots(self.model, self.slots, self.columns, cache, self.device, storage=self.static)
        elif need > self.slots_state.columns:  # a later turn's longer prompt, a cached prefix's gap
            self.columns = need + max(self.max_budget // 4, 16)
            self.slots_state.grow(self.columns)
        rows = rows[go_on]
        self.slots_state.admit(req[go_on], tok[go_on], lens[go_on], mask[rows],
                               [layer.keys[rows] for layer in cache.layers],
                               [layer.values[rows] for layer in cache.layers])

    def _pick(self, logits: torch.Tensor, req: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's next token: greedy or sampled, as its request asked."""
        if len(self._modes) == 1 and not (self._per_row and False in self._modes):
            return _sample(logits, next(iter(self._modes)), self.cfg)
        if self._per_row:
            tok, lp = _sample_rows(logits, self.temp[req], self.topp[req], self.cfg)
        else:
            tok, lp = _sample(logits, False, self.cfg)
        g_tok, g_lp = _sample(logits, True, self.cfg)
        g = self.greedy_req[req]
        return torch.where(g, g_tok, tok), torch.where(g, g_lp, lp)

    def _keep_prefixes(self, s: Slots, done: torch.Tensor) -> None:
        """Put the KV of the rows that just ended in the prefix cache, keyed by their tokens."""
        L = s.length
        for r in done.nonzero().squeeze(1).tolist():
            q = int(s.req[r])
            plen, n_gen = int(self.lengths[q]), int(self.gen_len[q])
            cols = s.valid[r, :L].nonzero().squeeze(1)
            if len(cols) != plen + n_gen - 1:  # not what this row should hold: keep nothing
                continue
            key = tuple(self.input_ids[q, :plen].tolist() + self.tokens[q, : n_gen - 1].tolist())
            self.prefix_cache.put(key, [(layer.keys_buf[r, :, cols], layer.values_buf[r, :, cols])
                                        for layer in s.cache.layers])

    def _decode(self, s: Slots) -> None:
        if s.length >= s.columns:
            s.compact()
        n, L = s.n, s.length
        s.valid[:n, L] = True
        s.sync_layers()
        if self.static is not None:
            logits = self.static.step(self.model, s, n)
        else:
            logits = self._forward(s.cache, s.last[:n, None], s.pos[:n, None], s.valid[:n, : L + 1])
        s.length = L + 1
        s.pos[:n] += 1
        tok, lp = self._pick(logits, s.req[:n])
        done = self._record(s.req[:n], tok, lp)
        s.last[:n] = tok
        if bool(done.any()):
            if self.prefix_cache is not None:
                self._keep_prefixes(s, done)
            s.drop(done)

    def _outputs(self) -> BatchedDataDict:
        """The `GenerationInterface` contract: prompt then generated tokens, right padded."""
        B, T = self.input_ids.shape
        gen_len, tokens, logprobs = self.gen_len.cpu(), self.tokens.cpu(), self.logprobs.cpu()
        total = self.lengths + gen_len
        width = int(total.max()) if B else 0
        out_ids = torch.full((B, T + self.max_budget), self.pad_id, dtype=torch.long)
        out_lp = torch.zeros((B, T + self.max_budget), dtype=torch.float32)
        prompt = torch.arange(T)[None] < self.lengths[:, None]
        out_ids[:, :T] = torch.where(prompt, self.input_ids.long(), self.pad_id)
        cols = self.lengths[:, None] + torch.arange(self.max_budget)[None]
        out_ids.scatter_(1, cols, tokens)  # tokens past a row's end are still pad
        out_lp.scatter_(1, cols, logprobs)
        return BatchedDataDict(
            output_ids=out_ids[:, :width],
            logprobs=out_lp[:, :width],
            generation_lengths=gen_len,
            unpadded_sequence_lengths=total,
            truncated=~self.ended.cpu(),
        )


def decoding_mode(model):
    """inference_mode (no autograd bookkeeping), or no_grad for an FSDP2 model: its hooks write to
    parameters in place, which inference mode forbids on ordinary tensors."""
    fsdp = any(type(m).__name__.startswith("FSDP") for m in model.modules())
    return torch.no_grad() if fsdp else torch.inference_mode()


def continuous_generate(model, tokenizer, data: BatchedDataDict, cfg: GenerationConfig, *, greedy: bool,
                        max_total_length: int, slots: int, device: torch.device,
                        prefix_cache: PrefixCache | None = None) -> BatchedDataDict:
    """`hf_generate`'s contract, decoded by continuous batching over `slots` rows (see module doc)."""
    with decoding_mode(model):
        out = ContinuousBatcher(model, tokenizer, data, cfg, greedy=greedy, max_total_length=max_total_length,
                                slots=slots, device=device, prefix_cache=prefix_cache).run()
    # Cloned outside inference mode: inference tensors cannot be saved for backward, and the training
    # step embeds these ids.
    return BatchedDataDict({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()})
