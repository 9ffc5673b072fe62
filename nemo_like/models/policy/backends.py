"""Training backends of the policy, by name (``policy.backend``): the worker class a ``Policy`` runs
as Ray actors, named by import path so that choosing one never imports another's framework.

A worker class is constructed with ``(policy_config, *, seed, init_reference_model, init_optimizer)``
and offers the methods in ``WORKER_METHODS`` (``HFPolicyWorker`` is the reference). A new backend is
one module with such a class plus one ``register_policy_backend("name", "pkg.module.Worker")``.

Imports nothing heavy: the config validates backend names before Ray starts.
"""

from __future__ import annotations

from nemo_like.utils.registry import Registry, worker_class_check

__all__ = ["POLICY_BACKENDS", "WORKER_METHODS", "policy_worker_cls", "register_policy_backend"]

WORKER_METHODS = ("get_logprobs", "get_reference_policy_logprobs", "train", "save_checkpoint", "load_checkpoint",
                  "export_merged", "weights_manifest", "export_weight_chunks", "weights_checksum")


POLICY_BACKENDS: Registry[type] = Registry(
    "policy backend", check=worker_class_check("policy backend", WORKER_METHODS, "policy worker"), builtins={
    # HF transformers under FSDP2 (or one process), CPU or CUDA; generates in the worker too.
    "hf": "nemo_like.models.policy.hf_worker.HFPolicyWorker",
    # Megatron-core GPTModel (Llama/Qwen2/Qwen3 shapes), CUDA only, optional extra nemo_like[megatron].
    "megatron": "nemo_like.models.policy.megatron_worker.MegatronPolicyWorker",
})


def register_policy_backend(name: str, cls_or_import_path: type | str, *, overwrite: bool = False) -> type | str:
    return POLICY_BACKENDS.register(name, cls_or_import_path, overwrite=overwrite)


def policy_worker_cls(name: str) -> type:
    """The worker class of backend ``name`` (KeyError with a did-you-mean if unknown)."""
    return POLICY_BACKENDS.get(name)
