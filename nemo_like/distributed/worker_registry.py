"""The driver's record of the workers its worker groups started, by Ray actor id: what an error about a
dead actor does not always say. Ray's ``ActorDiedError`` names the actor's class, name and node when the
death was seen; an ``ActorUnavailableError`` (a node lost while a call was in flight) carries only the
actor id. Kept import-light: the CLI reads it to name a dead worker in one line."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["StartedWorker", "record_worker", "started_worker"]


class StartedWorker(NamedTuple):
    class_name: str
    name: str  # the Ray actor name, <prefix>-<rank>-<group id>
    node_id: str  # hex id of the node it was placed on


_STARTED: dict[str, StartedWorker] = {}


def record_worker(actor_id: str, class_name: str, name: str, node_id: str) -> None:
    _STARTED[actor_id] = StartedWorker(class_name, name, node_id)


def started_worker(actor_id: str | None) -> StartedWorker | None:
    """The worker started as ``actor_id`` (hex), or None: not started by a worker group of this process."""
    return _STARTED.get(actor_id) if actor_id else None
