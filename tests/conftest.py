"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import ray

from nemo_like.distributed.ray_cluster import init_ray
from nemo_like.models.tiny import build_char_tokenizer, build_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny char-level Llama saved as an HF folder (hidden 64, 2 layers, 64 positions)."""
    d = tmp_path_factory.mktemp("tiny")
    tok = build_char_tokenizer(d)
    build_tiny_llama(tok, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=64, seed=0, save_dir=d)
    return str(d)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray of 2 CPUs for the module; what experiments start in it, they must free again."""
    started = init_ray(num_cpus=2)
    yield
    if started:
        ray.shutdown()
