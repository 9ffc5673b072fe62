"""A training backend: the HF policy worker with the token embeddings frozen (and the output head, when
the model ties the two), so that RL moves only the transformer layers, with no optimizer state for the
frozen weights.

    --import my_extensions.frozen_embeddings_worker policy.backend=frozen_embeddings
"""

from __future__ import annotations

from typing import Any

import torch

from my_extensions._trace import trace
from nemo_like.models.policy.backends import register_policy_backend
from nemo_like.models.policy.hf_worker import HFPolicyWorker
from nemo_like.models.policy.interfaces import PolicyConfig
from nemo_like.models.policy.lora import hf_model, trainable_parameters
from nemo_like.models.worker_base import make_optimizer


class FrozenEmbeddingsWorker(HFPolicyWorker):
    @staticmethod
    def check_config(config: PolicyConfig) -> None:
        """Run by the config before Ray starts: what this worker refuses."""
        if config.lora.enabled:
            raise ValueError("policy.backend=frozen_embeddings freezes the embeddings of a fully trained model; "
                             "with policy.lora.enabled the base weights are frozen already: use policy.backend=hf")

    def __init__(self, config: PolicyConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.embeddings = hf_model(self.model).get_input_embeddings().weight
        self.embeddings.requires_grad_(False)
        if self.optimizer is not None:  # built by the HF worker over every weight: again, over what trains
            self.optimizer, self.scheduler = make_optimizer(trainable_parameters(self.model), config.optimizer,
                                                            config.scheduler)
        optimized = sum(p.numel() for g in (self.optimizer.param_groups if self.optimizer else []) for p in g["params"])
        trace("training_worker", f"frozen={self.embeddings.numel()} optimized={optimized} total={self.num_params}")

    def train(self, *args: Any, **kwargs: Any) -> Any:
        before = self.embeddings.detach().clone()
        out = super().train(*args, **kwargs)
        trace("training_worker", f"embeddings_unchanged={torch.equal(before, self.embeddings.detach())}")
        return out


register_policy_backend("frozen_embeddings", FrozenEmbeddingsWorker)
