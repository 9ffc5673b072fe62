"""Generation backends of a separate rollout group, by name (``policy.generation.backend``).

A backend is a worker class that a ``RolloutGroup`` runs as Ray actors: constructed with
``(policy_config, *, seed)``, and offering ``generate(data, greedy) -> BatchedDataDict`` (the
``GenerationInterface`` contract plus a ``policy_version`` [B] tensor), ``update_weights(chunk_refs,
version) -> dict`` (named full tensors in chunks, see ``rollout_group.py``), ``weights_checksum()``,
``policy_version()`` and ``pad_token_id()``. A vLLM or SGLang engine is one module with such a class
plus one ``register_generation_backend("vllm", "pkg.module.VllmWorker")``; none is registered here,
because neither can be installed where this project is tested.

Imports nothing heavy: the config validates backend names before Ray starts.
"""

from __future__ import annotations

from nemo_like.utils.registry import Registry, worker_class_check

__all__ = ["GENERATION_BACKENDS", "WORKER_METHODS", "generation_worker_cls", "register_generation_backend"]

WORKER_METHODS = ("generate", "update_weights", "weights_checksum", "policy_version", "pad_token_id")


GENERATION_BACKENDS: Registry[type] = Registry(
    "generation backend", check=worker_class_check("generation backend", WORKER_METHODS, "rollout worker"), builtins={
    # HF transformers in the worker: `generate` or the continuous-batching engine (policy.generation.engine).
    "hf": "nemo_like.models.generation.rollout_worker.RolloutWorker",
})


def register_generation_backend(name: str, cls_or_import_path: type | str, *, overwrite: bool = False) -> type | str:
    return GENERATION_BACKENDS.register(name, cls_or_import_path, overwrite=overwrite)


def generation_worker_cls(name: str) -> type:
    """The worker class of backend ``name`` (KeyError with a did-you-mean if unknown)."""
    return GENERATION_BACKENDS.get(name)
