"""The HF generation backend: a prompt repeated G times is encoded once (shared KV cache), and the
results are those of the plain call."""

from __future__ import annotations

import pytest
import torch
from _nl_model_test_helpers import chat_prompts

from nemo_like.distributed.batched_data_dict import BatchedDataDict
from nemo_like.models.generation.hf_generation import hf_generate
from nemo_like.models.generation.interfaces import GenerationConfig
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_gen")
    tok = build_char_tokenizer(d)
    model = build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=96, seed=0)
    return tok, model.float().eval()


def _grpo_prompts(tok, G: int) -> BatchedDataDict:
    return chat_prompts(tok, ["1+2=", "13+45=", "99+1=", "5+60=", "7*7=", "70-8="], G)  # several lengths: left padding


@pytest.mark.parametrize("engine", ["generate", "continuous"])
@pytest.mark.parametrize("greedy", [False, True])
def test_shared_prompt_prefill_gives_the_plain_results(tiny, greedy, engine):
    tok, model = tiny
    data = _grpo_prompts(tok, G=4)
    assert len(set(data["input_lengths"].tolist())) > 1
    outs = []
    for share in (False, True):
        torch.manual_seed(0)
        cfg = GenerationConfig(max_new_tokens=12, share_prompt_prefill=share, engine=engine)
        outs.append(hf_generate(model, tok, data, cfg, greedy=greedy, max_total_length=80, micro_batch_size=10,
                                synced=False, device=torch.device("cpu")))
    plain, shared = outs
    assert torch.equal(plain["output_ids"], shared["output_ids"])  # the same sampled tokens, same seed
    assert torch.equal(plain["generation_lengths"], shared["generation_lengths"])
    assert torch.allclose(plain["logprobs"], shared["logprobs"], atol=1e-5)
    if not greedy:  # the samples of one prompt differ: the cache rows were copied, not tied
        g0 = shared["output_ids"][:4]
        assert len({tuple(r.tolist()) for r in g0}) > 1
