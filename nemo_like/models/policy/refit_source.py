"""The training worker's side of a refit: its weights as a generation engine holds them.

``HFPolicyWorker`` takes these methods; they use its ``model``, ``rank``, ``device`` and
``_reshard``. Every rank runs each method in step (gathering FSDP2 shards is a collective); rank 0
hands the tensors on: into the Ray object store (``export_weight_chunks``), or by broadcast over the
refit group it shares with the rollout workers (``broadcast_weights``, see
``nemo_like.models.generation.collective_refit``).
"""

from __future__ import annotations

import ray
import torch

import nemo_like.models.policy.weight_export as weight_export
from nemo_like.models.generation import collective_refit


class RefitSourceMixin:
    model: torch.nn.Module
    rank: int
    device: torch.device
    _refit_group = None
    _reshard: object  # the worker's: FSDP2 roots are left unsharded after a forward pass

    def export_weight_chunks(self, max_bytes: int) -> list[ray.ObjectRef]:
        """The model as it computes (plain HF names, LoRA merged) in object-store chunks of at most
        ``max_bytes``; every rank gathers in step, rank 0 puts each chunk as soon as it is full and
        returns the refs (other ranks: []). The store, not this list, holds the tensors."""
        self._reshard()  # after a forward pass the root's parameters are not shards
        emit = ray.put if self.rank == 0 else (lambda chunk: None)
        refs = weight_export.chunk_named_tensors(weight_export.iter_export_tensors(self.model), max_bytes, emit)
        return refs if self.rank == 0 else []

    def weights_manifest(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return weight_export.export_manifest(self.model)

    def weights_checksum(self) -> str:
        """sha256 of the exported view (weight_export.named_checksum); every rank gathers in step."""
        self._reshard()
        return weight_export.named_checksum(weight_export.iter_export_tensors(self.model))

    # ---- the collective transport --------------------------------------------------------------
    def refit_address(self) -> tuple[str, int]:
        return collective_refit.free_address()

    def join_refit_group(self, host: str, port: int, world: int, backend: str) -> None:
        """Rank 0 joins the refit group as its sender (rank 0 of that group); other ranks only gather."""
        if self.rank == 0:
            self._refit_group = collective_refit.open_group(host, port, 0, world, backend)

    def broadcast_weights(self, max_bytes: int) -> dict[str, float]:
        """Gather in step on every rank; rank 0 broadcasts to the refit group: bytes and buckets."""
        self._reshard()
        tensors = weight_export.iter_export_tensors(self.model)
        if self.rank != 0:
            for _ in tensors:
                pass
            return {}
        if self._refit_group is None:
            raise RuntimeError("broadcast_weights before join_refit_group: the refit group is not set up")
        nbytes, buckets = collective_refit.send(self._refit_group, tensors, self.weights_manifest(), max_bytes,
                                                self.device)
        return {"bytes": float(nbytes), "buckets": float(buckets)}
