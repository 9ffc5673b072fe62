"""Generation backend contract, so vLLM can replace the in-worker HF backend without touching GRPO."""

from __future__ import annotations

import abc
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.generation.backends import GENERATION_BACKENDS
from nemo_like.utils.options import apply_registered_options


class GenerationConfig(BaseModel):
    # "allow": the selected backend's own options (register_generation_backend(..., options=Model)),
    # checked by _other_backends_run_apart against that model.
    model_config = ConfigDict(extra="allow")
    # A registered generation backend (models/generation/backends.py): "hf" (transformers, in the
    # training workers when colocated, else in rollout workers). Another engine (vLLM, SGLang) is a
    # worker class in one module plus register_generation_backend(); it needs colocated: false.
    backend: str = Field("hf", min_length=1)
    # Tokens generated per assistant turn at most (less where policy.max_total_sequence_length is reached).
    max_new_tokens: int = Field(32, gt=0)
    # Sampling temperature; the trainer computes its log-probs at the same temperature. Validation is greedy.
    temperature: float = Field(1.0, gt=0)
    # Nucleus sampling: draw from the most likely tokens whose probabilities add up to this (1.0: off).
    # Like top_k, it is left out of the sampled tokens' log-probs (those of the temperature-scaled softmax).
    top_p: float = Field(1.0, gt=0, le=1)
    # Draw from the k most likely tokens only; None: off.
    top_k: int | None = Field(None, gt=0)
    # Strings that end a turn when generated (besides EOS), added to those a task sets itself.
    stop_strings: list[str] | None = None
    # Encode each distinct prompt once and share its KV cache with its repeats (GRPO's G samples).
    share_prompt_prefill: bool = True
    # "continuous": our own scheduler over the model's forward with a preallocated KV cache
    # (models/generation/engine.py): a sample that ends frees its row for the next waiting prompt,
    # finished rows are never computed again, and no step copies the whole cache. Its outputs are those
    # of "generate" (greedy ids equal, log-probs to float tolerance: tests/unit/models/test_engine.py),
    # and it measured faster on every workload of benchmarks/bench_generation.py (tiny model 1.63x with
    # full-length samples, 1.82x with ragged budgets; SmolLM2-135M shape 1.07x / 1.21x). "generate":
    # HF `generate` per micro-batch, each running until its longest sample ends. FSDP across ranks
    # (collectives in every forward) and models whose cache rows cannot be moved freely (sliding-window,
    # recurrent layers) always use "generate".
    engine: Literal["generate", "continuous"] = "continuous"
    # The continuous engine's decode step (models/generation/static_decode.py). "dynamic": each step
    # the shape of its live rows and used columns, run eagerly (fastest on a CPU). "static": a few fixed
    # shapes (rows padded to a power of two, attention over the whole cache under a mask), eagerly;
    # "compiled": those under torch.compile; "graphs": torch.compile(mode="reduce-overhead"), each
    # shape's step one CUDA graph, for GPUs, where the eager step is bound by Python and kernel launches
    # (on a CPU, "graphs" is "compiled"). Greedy outputs equal "dynamic"'s (tests/unit/models/
    # test_static_decode.py). Needs sdpa or eager attention.
    decode_mode: Literal["dynamic", "static", "compiled", "graphs"] = "dynamic"
    # Multi-turn rollouts with the continuous engine in one process (one training rank, or each rollout
    # worker): an episode's next turn is admitted as soon as its environment answers, while the other
    # rows keep decoding (nemo_like/experience/streaming.py). False (default): turn by turn, every
    # sample's turn generated, then all graded. Off because on 2 CPU cores it measured slower: the
    # graders' CPU work then competes with decoding for the same cores (docs/performance.md,
    # "Streamed episodes against turn by turn"). The same for agent programs: with it the trainer's
    # OpenAI-compatible server feeds each request into the worker's engine as it arrives (one rank).
    stream_episodes: bool = False
    # Prefix caching (models/generation/prefix_cache.py): a multi-turn episode's next turn is prefilled
    # on top of the KV its last turn left, not from scratch. At most this many tokens are kept per
    # worker (0, the default: off; None: max_num_seqs x policy.max_total_sequence_length); emptied when
    # weights change. Off by default: single-turn tasks never hit it, yet every finished row would be
    # copied into it, and on a GPU it can hold as much KV as the decoding slots themselves.
    prefix_cache_tokens: int | None = Field(0, ge=0)
    # Rows decoded together by the continuous engine; None: policy.generation_batch_size.
    max_num_seqs: int | None = Field(None, gt=0)
    # True: generate inside the training workers (same weights, nothing to send; one device). False: a
    # separate rollout worker group (cluster.generation) that is sent the weights after every update.
    colocated: bool = True
    # A refit to a separate rollout group streams named tensors in chunks of at most this many MiB, so
    # neither side ever holds a second full copy of the weights in flight.
    refit_chunk_mb: float = Field(64.0, gt=0)
    # How a refit moves the weights: "object_store" (the policy's rank 0 puts chunks in Ray's object
    # store, every rollout worker fetches them; through host memory) or "collective" (a broadcast over a
    # process group of the policy's rank 0 and the rollout workers: gloo on CPUs, NCCL GPU to GPU).
    refit_transport: Literal["object_store", "collective"] = "object_store"


    @model_validator(mode="after")
    def _other_backends_run_apart(self) -> GenerationConfig:
        apply_registered_options(self, "policy.generation", [(GENERATION_BACKENDS, self.backend)])
        # Colocated generation is the training workers' own HF model; any other engine is a worker of its own.
        if self.colocated and self.backend != "hf":
            raise ValueError(f"policy.generation.backend={self.backend!r} generates in a rollout group of its own: "
                             "set policy.generation.colocated=false (colocated generation is the training workers' HF)")
        return self

class GenerationInterface(abc.ABC):
    """Input `data`: input_ids [B,T] right padded, input_lengths [B], optional stop_strings (list).
    Output: output_ids [B,T'] (prompt followed by the generated tokens, right padded),
    logprobs [B,T'] (log-prob of each generated token under the sampling distribution, 0 elsewhere),
    generation_lengths [B], unpadded_sequence_lengths [B], truncated [B] (hit its token limit
    without an end-of-sequence token or stop string). Each sample's limit is its own:
    min(max_new_tokens, max_total_sequence_length - its input length)."""

    @abc.abstractmethod
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict: ...

    def streams_episodes(self) -> bool:
        """Whether ``generate_episodes`` runs whole multi-turn rollouts where the model is."""
        return False

    def generate_episodes(self, batch: BatchedDataDict, envs: dict, *, max_turns: int, max_seq_len: int,
                          greedy: bool = False, step_timeouts: dict[str, float] | None = None,
                          step_concurrency: dict[str, int] | None = None) -> tuple[BatchedDataDict, dict[str, float]]:
        """``run_multi_turn_rollout``'s result, with each episode's next turn started as soon as its
        environment answers (only where ``streams_episodes()``)."""
        raise NotImplementedError(f"{type(self).__name__} does not stream episodes")

    def prepare_for_generation(self) -> None:
        return None

    def finish_generation(self) -> None:
        return None
