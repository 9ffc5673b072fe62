"""One rollout worker: a plain HF causal LM that only generates, refit with the policy's weights.

``RolloutGroup`` makes one Ray actor of this class per ``cluster.generation`` worker. The model is
the plain HF model of ``policy.model_name`` (with ``policy.lora`` too: a refit sends merged weights,
so there is no adapter here), float32 on a CPU and ``policy.precision`` on a GPU, in eval mode.

Its calls run on threads of their own (``max_concurrency``): every ``generate_episodes`` call feeds
one engine shared by all (``shared_engine.py``), so the episodes of two batches in flight decode
together, and everything that touches the weights (a refit, ``generate``, a checksum) runs on the
engine's thread between two of its steps. ``min_version`` makes a call wait for the refit sent
before it (Ray does not order a threaded actor's calls).

``update_weights`` is strict: every parameter must arrive (once per chunk stream), under a name the
model has, in its shape. Chunks are fetched one at a time, so the worker holds at most one chunk
beside its own weights; the engine pauses while they load. A refit that fails part way leaves some
parameters new and some old: the worker then refuses to generate until a refit succeeds, rather
than sample from a mix (episodes decoding at the time fail with that error).
"""

from __future__ import annotations

import os
import time

import ray
import torch

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.experience.streaming import close_stream, open_stream, stream_episodes
from nemo_like.models.generation import collective_refit
from nemo_like.models.generation.engine import ContinuousBatcher, unsupported_reason
from nemo_like.models.generation.hf_generation import hf_generate
from nemo_like.models.generation.prefix_cache import make_prefix_cache
from nemo_like.models.generation.shared_engine import SharedEngine
from nemo_like.models.policy.interfaces import PolicyConfig
from nemo_like.models.policy.weight_export import named_checksum, tensor_bytes
from nemo_like.models.worker_base import PRECISION_DTYPES, pick_device

# What generate() passes to the engine; anything else in a batch (rewards, message logs) stays behind.
GENERATE_KEYS = ("input_ids", "input_lengths", "stop_strings")
# How long a call waits for the refit sent before it to load.
VERSION_WAIT_S = 600.0


class RolloutWorker:
    # Threads for its calls (RolloutGroup makes the actor with it): every batch in flight, a
    # validation, a refit and checks at once, with room to spare.
    max_concurrency = 16
    # See models/generation/backends.py: what this backend does beyond the required methods.
    capabilities = frozenset({"streaming", "collective_refit", "trainer_logprobs"})

    def __init__(self, config: PolicyConfig, *, seed: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = config
        self.rank = int(os.environ.get("RANK", "0"))
        # The group sets NEMO_LIKE_NUM_THREADS to this worker's CPU share: more threads than that
        # would oversubscribe the cores shared with the training workers.
        threads = config.num_threads or int(os.environ.get("NEMO_LIKE_NUM_THREADS", "1"))
        torch.set_num_threads(max(1, threads))
        use_cuda = os.environ.get("NEMO_LIKE_USE_GPU", "0") == "1"
        self.device = pick_device(use_cuda)
        if use_cuda:
            torch.cuda.set_device(self.device)
        # Sampling differs per worker (different shards would otherwise share one random stream).
        torch.manual_seed(seed + self.rank)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_name or config.model_name,
                                                       trust_remote_code=config.trust_remote_code)
        dtype = PRECISION_DTYPES[config.precision] if use_cuda else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(config.model_name, dtype=dtype,
                                                          trust_remote_code=config.trust_remote_code)
        self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        # Every name a parameter answers to (tied weights have two) -> the parameter itself.
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._unique = dict(self.model.named_parameters())
        self._prefix_cache = make_prefix_cache(config)  # next turns reuse their episode's KV
        # Environment calls in flight per task, over every stream of this worker's shared engine.
        self._env_calls: dict[str, int] = {}
        self._dirty: str | None = None  # why the weights are a mix of two versions, if they are
        self._failed: tuple[int, str] | None = None  # the last refit that failed: (version, why)
        self._slots = config.generation.max_num_seqs or config.generation_batch_size
        self._engine = SharedEngine(self.model, self._new_batcher, self._check_clean,
                                    name=f"nemo-like-rollout-engine-{self.rank}")

    @property
    def _version(self) -> int:  # of the weights loaded (0: those of policy.model_name, before any refit)
        return self._engine.version

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, data: BatchedDataDict, greedy: bool = False, min_version: int = 0) -> BatchedDataDict:
        """Policy.generate's contract, plus ``policy_version`` [B] (int64): the refit version of the
        weights that generated each sample (at least ``min_version``)."""
        self._await_version(min_version)
        sub = BatchedDataDict({k: data[k] for k in GENERATE_KEYS if k in data})

        def run() -> BatchedDataDict:
            self._check_clean()
            out = hf_generate(self.model, self.tokenizer, sub, self.cfg.generation, greedy=greedy,
                              max_total_length=self.cfg.max_total_sequence_length,
                              micro_batch_size=self.cfg.generation_batch_size, synced=False, device=self.device,
                              prefix_cache=self._prefix_cache)
            out["policy_version"] = torch.full((out.size,), self._version, dtype=torch.int64)
            return out
        return self._engine.call(run)

    def generate_episodes(self, data: BatchedDataDict, envs: dict, min_version: int = 0,
                          **kwargs) -> tuple[BatchedDataDict, dict[str, float]]:
        """``stream_episodes``'s result, decoded by the engine this worker's calls share; each turn
        records the weights version it started with (at least ``min_version``)."""
        self._await_version(min_version)
        if unsupported_reason(self.model) is not None:  # turn by turn with HF generate, alone on the model
            return self._engine.call(lambda: stream_episodes(
                self.model, self.tokenizer, data, envs, self.cfg.generation,
                max_total_length=self.cfg.max_total_sequence_length, slots=self._slots, device=self.device,
                version=self._version, prefix_cache=self._prefix_cache, **kwargs))
        self._check_clean()
        source = open_stream(data, self.tokenizer, envs, max_turns=kwargs.pop("max_turns"),
                             max_seq_len=kwargs.pop("max_seq_len"), version=self._version,
                             calls_in_flight=self._env_calls, **kwargs)
        t0 = time.perf_counter()
        try:
            self._engine.stream(source)
        except BaseException:
            self._engine.call(source.release_calls)  # on the engine thread, like every other count
            raise
        return close_stream(source, time.perf_counter() - t0)

    def _new_batcher(self) -> ContinuousBatcher:
        """The shared engine's batcher (streams say per request whether they decode greedily)."""
        return ContinuousBatcher(self.model, self.tokenizer, None, self.cfg.generation, greedy=False,
                                 max_total_length=self.cfg.max_total_sequence_length, slots=self._slots,
                                 device=self.device, prefix_cache=self._prefix_cache)

    def _await_version(self, version: int) -> None:
        def broken() -> str | None:
            if self._dirty:
                return self._unusable()
            if self._failed is not None and self._failed[0] >= version:
                return f"rollout worker {self.rank}: its refit to version {self._failed[0]} failed: {self._failed[1]}"
            return None
        self._engine.wait_for_version(int(version), VERSION_WAIT_S, broken)

    def _unusable(self) -> str | None:
        if not self._dirty:
            return None
        return (f"rollout worker {self.rank}: the last weight update failed part way ({self._dirty}); "
                "its weights are a mix of two versions, refit before generating")

    def _check_clean(self) -> None:
        if why := self._unusable():
            raise RuntimeError(why)

    # ---- refit --------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, chunk_refs: list[ray.ObjectRef], version: int) -> dict[str, float]:
        """Load the named tensors of ``chunk_refs`` (each a ``list[tuple[str, Tensor]]`` in the object
        store), one chunk at a time, and call the result ``version``. Returns bytes loaded and seconds."""
        # One chunk alive at a time; fetched on the engine's thread, which pauses meanwhile.
        return self._engine.call(self._load_stream, (ray.get(ref) for ref in chunk_refs), version)

    # The collective transport (collective_refit.py): join once, check each manifest, then receive.
    def join_refit_group(self, host: str, port: int, rank: int, world: int, backend: str) -> None:
        self._refit_group = collective_refit.open_group(host, port, rank, world, backend)

    def check_manifest(self, manifest: collective_refit.Manifest) -> None:
        if getattr(self, "_refit_group", None) is None:  # e.g. restarted by Ray since the group was made
            raise RuntimeError(f"rollout worker {self.rank} is not in the refit group (restarted?); it is made anew")
        collective_refit.check_manifest(manifest, self._params, f"rollout worker {self.rank}")

    @torch.no_grad()
    def receive_weights(self, manifest: collective_refit.Manifest, max_bytes: int, version: int) -> dict[str, float]:
        """The policy's broadcast of ``manifest``'s tensors, loaded as ``update_weights`` loads chunks."""
        if getattr(self, "_refit_group", None) is None:
            raise RuntimeError(f"rollout worker {self.rank}: receive_weights before join_refit_group")
        return self._engine.call(lambda: self._load_stream(
            collective_refit.receive(self._refit_group, manifest, max_bytes, self.device), version))

    def _load_stream(self, chunks, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        loaded: set[int] = set()
        nbytes = n_chunks = 0
        try:
            for i, chunk in enumerate(chunks):
                nbytes += self._load_chunk(i, chunk, loaded)
                n_chunks += 1
            if missing := sorted(n for n, p in self._unique.items() if id(p) not in loaded):
                raise ValueError(f"{len(missing)} parameter(s) of the rollout model were never sent: {missing[:10]}"
                                 f"{' ...' if len(missing) > 10 else ''}")
        except Exception as e:
            # Untouched weights are still the old version; once one was copied they are a mix.
            if loaded:
                self._dirty = f"{type(e).__name__}: {e}"
            self._failed = (int(version), f"{type(e).__name__}: {e}")
            self._engine.set_version(self._version)  # wakes the calls waiting for it: they raise
            kind = type(e) if type(e) in (TypeError, ValueError) else RuntimeError
            raise kind(f"rollout worker {self.rank} refit to version {version}: {e}") from e
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._dirty = self._failed = None
        if self._prefix_cache is not None:  # KV of the old weights
            self._prefix_cache.clear()
        self._engine.set_version(int(version))
        return {"bytes": float(nbytes), "seconds": time.perf_counter() - t0, "chunks": float(n_chunks)}

    def _load_chunk(self, i: int, chunk: object, loaded: set[int]) -> int:
        if not isinstance(chunk, list):
            raise TypeError(f"chunk {i} is a {type(chunk).__name__}, not a list of (name, tensor) pairs")
        nbytes = 0
        for item in chunk:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                raise TypeError(f"chunk {i} holds {type(item).__name__} {str(item)[:80]!r}, not a (name, tensor) pair")
            name, t = item
            p = self._params.get(name)
            if p is None:
                raise ValueError(f"tensor {name!r} (chunk {i}) is not a parameter of the rollout model "
                                 f"{self.cfg.model_name}; its parameters are e.g. {sorted(self._unique)[:5]}")
            if p.shape != t.shape:
                raise ValueError(f"tensor {name!r} (chunk {i}) has shape {tuple(t.shape)}, but the rollout model's "
                                 f"parameter has shape {tuple(p.shape)}")
            if id(p) in loaded:
                raise ValueError(f"tensor {name!r} (chunk {i}) was sent twice (or under two tied names)")
            p.copy_(t)
            loaded.add(id(p))
            nbytes += tensor_bytes(t)
        return nbytes

    # ---- introspection ------------------------------------------------------------------------
    def weights_checksum(self) -> str:
        """The same definition as ``HFPolicyWorker.weights_checksum`` (weight_export.named_checksum)."""
        return self._engine.call(named_checksum, self._unique.items())

    def policy_version(self) -> int:
        return self._version

    def pad_token_id(self) -> int:
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def release_generation_memory(self) -> None:
        def release() -> None:
            if self._prefix_cache is not None:
                self._prefix_cache.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self._engine.call(release)
