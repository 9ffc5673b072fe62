"""A generation backend with an option of its own: the HF rollout worker, generating each batch in chunks
of at most ``chunk_rows`` prompts (a stand-in for an engine with a fixed batch limit).

    --import my_extensions.chunked_backend policy.generation.colocated=false \\
        policy.generation.backend=chunked policy.generation.chunk_rows=4
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from my_extensions._trace import trace
from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.generation.backends import register_generation_backend
from nemo_like.models.generation.rollout_worker import RolloutWorker


class ChunkedOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    chunk_rows: int = Field(8, gt=0)


@register_generation_backend("chunked", options=ChunkedOptions)
class ChunkedWorker(RolloutWorker):
    # It keeps the HF worker's numbers, but neither streams episodes nor takes a broadcast refit.
    capabilities = frozenset({"trainer_logprobs"})

    def generate(self, data: BatchedDataDict, greedy: bool = False, min_version: int = 0) -> BatchedDataDict:
        rows = self.cfg.generation.chunk_rows
        parts = [super(ChunkedWorker, self).generate(data.slice(i, min(i + rows, data.size)), greedy, min_version)
                 for i in range(0, data.size, rows)]
        trace("backend", f"chunk_rows={rows} rows={data.size} chunks={len(parts)}")
        return BatchedDataDict.from_batches(parts, pad_value_dict={"output_ids": self.pad_token_id()})
