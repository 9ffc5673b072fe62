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


@pytest.fixture(scope="session")
def ray_session():
    """The one local Ray of the test session. 4 logical CPUs on a 2-core machine: a module's 2-rank
    policy cluster plus a single worker fit at once; tests run one at a time, so nothing is
    oversubscribed. Whatever a module starts in it (clusters, actors), it must free again.

    Ray hands the driver's ``sys.path`` to its workers once, when it starts; pytest has put every
    test directory on it during collection, so helper modules beside the tests import in actors."""
    started = init_ray(num_cpus=4)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def base_model_cache(tmp_path_factory):
    """One ``bootstrap.cache_dir`` for the session, as a user's runs share ~/.cache/nemo_like. Its
    folders are keyed by everything the base model's SFT reads (``bootstrap_cache_path``), so tests
    whose bootstrap recipes match build the model once (e.g. the 150-step model of the PPO and
    Megatron tests, ~13 s a build) and a test with another recipe still builds its own."""
    return tmp_path_factory.mktemp("base_model_cache")
