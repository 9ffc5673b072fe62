"""The policy's weights as a generation engine would hold them: named full tensors, for a refit.

The exported view is the plain HF model's parameters (``AutoModelForCausalLM.from_pretrained``
names, tied weights once, as ``named_parameters`` lists them): FSDP2 shards are gathered whole
(``full_tensor``, a collective: every rank iterates in the same order), and with LoRA each adapted
layer's base weight carries its adapter merged in (``W + scaling * B @ A``, peft's own merge) under
the base layer's plain name, the adapter tensors themselves left out. The training model is never
modified: the merge is computed on the gathered copy.

``chunk_named_tensors`` cuts that stream into chunks of at most ``max_bytes`` (a bigger tensor is a
chunk of its own) and hands each to a callback as soon as it is full, so the caller can put it
somewhere (the Ray object store) and drop it before the next one is gathered: the exporter holds
at most one chunk of gathered tensors at a time, never a second full copy of the model.

``named_checksum`` is the one definition of "the same weights" both ends of a refit use.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import torch

from nemo_like.models.policy.lora import hf_model

NamedTensor = tuple[str, torch.Tensor]
T = TypeVar("T")

# Parameter names peft gives an adapter's own tensors; the merged view has none of them.
_ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")
_BASE_LAYER = ".base_layer"


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU: a DTensor (FSDP2 shard) is gathered, a plain tensor kept as is
    (no copy on a CPU: whoever consumes it serialises it before the parameter changes again)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.cpu()


def _lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module name (as ``hf_model`` names it) -> peft LoRA layer wrapping a base layer."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}


def _lora_delta(name: str, layer: torch.nn.Module, base_dtype: torch.dtype) -> torch.Tensor:
    """``scaling * B @ A`` of every active adapter of ``layer`` (peft's ``get_delta_weight``, on
    gathered tensors: under FSDP2 the adapter's A and B are shards)."""
    delta: torch.Tensor | None = None
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            # An Embedding/Conv adapter keeps its tensors elsewhere; nothing in this project makes one.
            raise NotImplementedError(f"weight export: LoRA layer {name!r} (adapter {adapter!r}) is not a linear "
                                      f"adapter ({type(layer).__name__}); only linear adapters can be merged")
        if getattr(layer, "use_dora", {}).get(adapter, False):
            raise NotImplementedError(f"weight export: LoRA layer {name!r} uses DoRA, which is not merged here")
        a = _full(layer.lora_A[adapter].weight).float()
        b = _full(layer.lora_B[adapter].weight).float()
        d = (b @ a) * layer.scaling[adapter]
        if getattr(layer, "fan_in_fan_out", False):  # GPT-2's Conv1D stores weights transposed
            d = d.T
        delta = d if delta is None else delta + d
    if delta is None:
        raise RuntimeError(f"weight export: LoRA layer {name!r} has no active adapter")
    return delta.to(base_dtype)


def iter_export_tensors(model: torch.nn.Module) -> Iterator[NamedTensor]:
    """(plain HF name, full CPU tensor) of every parameter of the model as it computes now; a
    collective under FSDP2 (every rank must exhaust it, in step)."""
    inner = hf_model(model)
    layers = _lora_layers(inner)
    for name, p in inner.named_parameters():
        if any(part in name for part in _ADAPTER_PARTS):
            continue
        t = _full(p)
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(_BASE_LAYER):
            wrapper = owner[: -len(_BASE_LAYER)]
            if leaf == "weight" and wrapper in layers and not layers[wrapper].disable_adapters:
                # A new tensor: the shard's gathered copy (or, unsharded, the parameter) is untouched.
                t = t + _lora_delta(wrapper, layers[wrapper], t.dtype)
            name = f"{wrapper}.{leaf}"
        yield name, t


def export_manifest(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of what ``iter_export_tensors`` yields, without gathering anything
    (a DTensor knows its global shape): what a receiver can preallocate and check against."""
    out = []
    for name, p in hf_model(model).named_parameters():
        if any(part in name for part in _ADAPTER_PARTS):
            continue
        out.append((name.replace(_BASE_LAYER + ".", "."), tuple(p.shape), p.dtype))
    return out


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def chunk_named_tensors(tensors: Iterable[NamedTensor], max_bytes: int,
                        emit: Callable[[list[NamedTensor]], T]) -> list[T]:
    """``emit(chunk)`` for consecutive chunks of at most ``max_bytes`` (a bigger tensor alone);
    returns what ``emit`` returned, in order. The chunk is released after ``emit``."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    out: list[T] = []
    chunk: list[NamedTensor] = []
    size = 0
    for name, t in tensors:
        n = tensor_bytes(t)
        if chunk and size + n > max_bytes:
            out.append(emit(chunk))
            chunk, size = [], 0
        chunk.append((name, t))
        size += n
    if chunk:
        out.append(emit(chunk))
    return out


def tensor_digest(name: str, t: torch.Tensor) -> bytes:
    """sha256 of a tensor's name, dtype, shape and bytes (contiguous, on the CPU)."""
    h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def named_checksum(tensors: Iterable[NamedTensor]) -> str:
    """One hex sha256 over every named tensor, independent of the order they come in (sorted by
    name), holding one tensor at a time."""
    digests = sorted((name, tensor_digest(name, t)) for name, t in tensors)
    h = hashlib.sha256()
    for _, d in digests:
        h.update(d)
    return h.hexdigest()


def read_safetensors_folder(folder: str | Path, what: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Every tensor of a folder's ``*.safetensors`` files (a ``save_pretrained`` layout, sharded or
    not); FileNotFoundError naming the folder and ``what`` it should have been if there are none."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights in the {what}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd
