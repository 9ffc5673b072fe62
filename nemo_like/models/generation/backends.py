"""Generation backends of a separate rollout group, by name (``policy.generation.backend``).

A backend is a worker class that a ``RolloutGroup`` runs as Ray actors, one per
``cluster.generation`` worker; its contract is :class:`GenerationWorker`, checked when the class is
registered (and again when an import path resolves). A vLLM or SGLang engine is one module with
such a class plus one ``register_generation_backend("vllm", "pkg.module.VllmWorker")``; none is
registered here, because neither can be installed where this project is tested.

What a backend can do beyond the required methods it declares in ``capabilities`` (a class
attribute), not by its name:

- ``"streaming"``: ``generate_episodes`` runs whole multi-turn episodes where the model is
  (``policy.generation.stream_episodes``);
- ``"collective_refit"``: ``join_refit_group``, ``check_manifest`` and ``receive_weights`` take a
  broadcast refit (``policy.generation.refit_transport: collective``);
- ``"trainer_logprobs"``: at float32 its sampling log-probs are the training model's own numbers, so
  ``grpo.reuse_generation_logprobs: auto`` may skip the old-policy pass.

A declared capability whose methods are missing, or one not in ``CAPABILITIES``, is refused at
registration. A backend's own config keys (``policy.generation.<key>``) are a pydantic model given as
``register_generation_backend(..., options=Model)``.

Imports nothing heavy: the config validates backend names before Ray starts.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

from nemo_like.utils.registry import Registry, worker_class_check

__all__ = ["CAPABILITIES", "GENERATION_BACKENDS", "GenerationWorker", "WORKER_METHODS", "backend_capabilities",
           "generation_worker_cls", "register_generation_backend"]


@runtime_checkable
class GenerationWorker(Protocol):
    """What a rollout worker class offers (constructed as ``cls(policy_config, *, seed)``).

    - ``generate(data, greedy=False, min_version=0)``: ``data`` holds ``input_ids`` [B, T] (right
      padded), ``input_lengths`` [B] and optionally ``stop_strings``; returns the
      ``GenerationInterface`` outputs (``output_ids`` [B, T'], ``logprobs`` [B, T'],
      ``generation_lengths`` [B], ``unpadded_sequence_lengths`` [B], ``truncated`` [B]) plus
      ``policy_version`` [B]: the weights' version each sample was generated with. A class with
      ``max_concurrency`` > 1 (a threaded actor, whose calls may run out of order) must first wait
      until the refit of version ``min_version`` has loaded.
    - ``update_weights(chunk_refs, version) -> dict[str, float]``: load named full tensors from Ray
      object refs (chunks of ``{name: tensor}``), strictly: every parameter once, known names,
      matching shapes; then record ``version``.
    - ``weights_checksum() -> str``, ``policy_version() -> int``, ``pad_token_id() -> int``.
    - ``release_generation_memory()``: free caches after a rollout on a GPU (a no-op elsewhere).
    """

    capabilities: ClassVar[frozenset[str]]

    def generate(self, data: Any, greedy: bool = False, min_version: int = 0) -> Any: ...
    def update_weights(self, chunk_refs: list[Any], version: int) -> dict[str, float]: ...
    def weights_checksum(self) -> str: ...
    def policy_version(self) -> int: ...
    def pad_token_id(self) -> int: ...
    def release_generation_memory(self) -> None: ...


WORKER_METHODS = ("generate", "update_weights", "weights_checksum", "policy_version", "pad_token_id",
                  "release_generation_memory")
# capability -> the methods it needs
CAPABILITIES: dict[str, tuple[str, ...]] = {
    "streaming": ("generate_episodes",),
    "collective_refit": ("join_refit_group", "check_manifest", "receive_weights"),
    "trainer_logprobs": (),
}

_check_methods = worker_class_check("generation backend", WORKER_METHODS, "rollout worker")


def _check_backend(name: str, cls: Any) -> None:
    _check_methods(name, cls)
    caps = getattr(cls, "capabilities", frozenset())
    if not isinstance(caps, (set, frozenset, tuple, list)):
        raise TypeError(f"generation backend {name!r}: {cls.__qualname__}.capabilities must be a set of names, "
                        f"got {type(caps).__name__}")
    for cap in caps:
        if cap not in CAPABILITIES:
            raise TypeError(f"generation backend {name!r}: unknown capability {cap!r}; known: {sorted(CAPABILITIES)}")
        if missing := [m for m in CAPABILITIES[cap] if not callable(getattr(cls, m, None))]:
            raise TypeError(f"generation backend {name!r}: capability {cap!r} needs {missing} on {cls.__qualname__}")


GENERATION_BACKENDS: Registry[type] = Registry("generation backend", check=_check_backend, builtins={
    # HF transformers in the worker: `generate` or the continuous-batching engine (policy.generation.engine).
    "hf": "nemo_like.models.generation.rollout_worker.RolloutWorker",
})


def register_generation_backend(name: str, cls_or_import_path: type | str | None = None, *, options: Any = None,
                                overwrite: bool = False) -> Any:
    """``register_generation_backend("vllm", "pkg.module.VllmWorker")``, or as a class decorator.
    ``options``: a pydantic model of the backend's own ``policy.generation.<key>`` options."""
    return GENERATION_BACKENDS.register(name, cls_or_import_path, overwrite=overwrite, options=options)


def generation_worker_cls(name: str) -> type:
    """The worker class of backend ``name`` (KeyError with a did-you-mean if unknown)."""
    return GENERATION_BACKENDS.get(name)


def backend_capabilities(name: str) -> frozenset[str]:
    """What backend ``name`` declared it can do (see the module docstring)."""
    return frozenset(getattr(generation_worker_cls(name), "capabilities", frozenset()))
