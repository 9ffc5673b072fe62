"""Placeholder written by the integrator; its helper replaces this module."""

from __future__ import annotations

from typing import Any

from nemo_like.environments.interfaces import EnvironmentInterface, EnvironmentReturn


class HttpEnvironment(EnvironmentInterface):
    def __init__(self, config: dict | None = None) -> None:
        self.config = dict(config or {})

    def step(self, message_log_batch: Any, metadata: Any) -> EnvironmentReturn:
        raise NotImplementedError
