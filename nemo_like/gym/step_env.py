"""Step environments: simulators an agent acts in one discrete action at a time (games, control).

The contract (:class:`StepEnvironment`) is gymnasium's, cut to what a GRPO collector needs:

    reset(seed) -> obs
    step(action) -> (obs, reward, terminated, truncated, info)
    spec() -> ObsSpec           # what the policy network is built for

An observation is a float vector ``[D]``, an image ``[C, H, W]``, or a mapping
``{"image": [C, H, W], "vector": [D]}`` (an image with a float vector beside it). The collector casts
it to float32 as it is: a class of your own should scale pixels to [0, 1] itself (the gymnasium
wrapper divides uint8 images by 255).

Names resolve through :data:`STEP_ENV_REGISTRY` (the same registry shape as the LLM environments:
a class or an import path, ``register_step_env("my_env", MyEnv)``); a name nobody registered that
gymnasium knows (``"CartPole-v1"``, ``"Acrobot-v1"``) is wrapped by :class:`GymnasiumEnvironment`.
Collectors (nemo_like.gym.collector) run these inside Ray actors.
"""

from __future__ import annotations

import difflib
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from nemo_like.utils.registry import Registry

__all__ = ["GymnasiumEnvironment", "ObsSpec", "STEP_ENV_REGISTRY", "StepEnvironment", "check_step_env_name",
           "make_step_env", "register_step_env", "step_env_factory"]


@dataclass(frozen=True)
class ObsSpec:
    """The observation a network is built for and the number of discrete actions.

    ``vector_dim``: length of the float vector (0: none); ``image_shape``: ``(C, H, W)`` or None."""

    num_actions: int
    vector_dim: int = 0
    image_shape: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.num_actions < 2:
            raise ValueError(f"a step environment needs at least 2 discrete actions, got {self.num_actions}")
        if self.vector_dim <= 0 and self.image_shape is None:
            raise ValueError("an observation needs a vector (vector_dim > 0) or an image (image_shape)")

    @property
    def kind(self) -> str:
        if self.image_shape is None:
            return "vector"
        return "image+vector" if self.vector_dim else "image"


class StepEnvironment(ABC):
    """One episode at a time; a collector owns several instances. Subclass it, or register any class
    with these methods. ``step`` may raise or return a non-finite reward: the collector drops that
    episode (counted) and builds a fresh instance, so a buggy simulator never stops a run."""

    @abstractmethod
    def spec(self) -> ObsSpec: ...

    @abstractmethod
    def reset(self, seed: int) -> Any: ...

    @abstractmethod
    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


def _box_spec(space: Any, what: str) -> tuple[int, tuple[int, int, int] | None, bool]:
    """(vector_dim, image_shape, channels_last) of a gymnasium Box."""
    shape = tuple(space.shape)
    if len(shape) == 1:
        return shape[0], None, False
    if len(shape) == 2:  # a grey image [H, W]
        return 0, (1, shape[0], shape[1]), False
    if len(shape) == 3:
        channels_last = shape[-1] in (1, 3, 4) and shape[0] not in (1, 3, 4)
        c, h, w = (shape[2], shape[0], shape[1]) if channels_last else shape
        return 0, (c, h, w), channels_last
    raise ValueError(f"{what}: observation shape {shape} is not a vector, an image [H, W] or [C, H, W]/[H, W, C]")


class GymnasiumEnvironment(StepEnvironment):
    """A gymnasium environment by id (``gymnasium.make(env_id, **kwargs)``). Images are returned as
    float32 ``[C, H, W]`` (uint8 pixels divided by 255); Dict spaces with ``image`` and ``vector``
    keys are supported."""

    def __init__(self, env_id: str, max_episode_steps: int | None = None, **kwargs: Any) -> None:
        import gymnasium

        extra = {"max_episode_steps": max_episode_steps} if max_episode_steps else {}
        self.env_id = env_id
        # The passive checker re-validates spaces on the first calls of every instance; the contract
        # is checked here once, and by the collector on every observation.
        self._env = gymnasium.make(env_id, disable_env_checker=True, **extra, **kwargs)
        act = self._env.action_space
        if not isinstance(act, gymnasium.spaces.Discrete):
            raise ValueError(f"step environment {env_id!r}: action space {act} is not Discrete "
                             "(the GRPO agent policy is a categorical over discrete actions)")
        self._start = int(act.start)
        obs = self._env.observation_space
        self._keys: tuple[str, ...] = ()
        if isinstance(obs, gymnasium.spaces.Dict):
            if set(obs.spaces) != {"image", "vector"}:
                raise ValueError(f"step environment {env_id!r}: a Dict observation needs exactly the keys "
                                 f"'image' and 'vector', got {sorted(obs.spaces)}")
            _, image_shape, self._channels_last = _box_spec(obs.spaces["image"], env_id)
            vector_dim = _box_spec(obs.spaces["vector"], env_id)[0]
            self._keys = ("image", "vector")
            self._scale = obs.spaces["image"].dtype == np.uint8
        elif isinstance(obs, gymnasium.spaces.Box):
            vector_dim, image_shape, self._channels_last = _box_spec(obs, env_id)
            self._scale = image_shape is not None and obs.dtype == np.uint8
        else:
            raise ValueError(f"step environment {env_id!r}: observation space {type(obs).__name__} is not "
                             "supported (a Box vector or image, or a Dict of 'image' and 'vector')")
        self._spec = ObsSpec(num_actions=int(act.n), vector_dim=vector_dim, image_shape=image_shape)

    def _image(self, x: Any) -> np.ndarray:
        img = np.asarray(x, dtype=np.float32)
        if img.ndim == 2:
            img = img[None]
        elif self._channels_last:
            img = np.transpose(img, (2, 0, 1))
        return img / 255.0 if self._scale else img

    def _convert(self, obs: Any) -> Any:
        if self._keys:
            return {"image": self._image(obs["image"]), "vector": np.asarray(obs["vector"], dtype=np.float32)}
        if self._spec.image_shape is not None:
            return self._image(obs)
        return np.asarray(obs, dtype=np.float32)

    def spec(self) -> ObsSpec:
        return self._spec

    def reset(self, seed: int) -> Any:
        obs, _ = self._env.reset(seed=int(seed))
        return self._convert(obs)

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self._env.step(int(action) + self._start)
        return self._convert(obs), float(reward), bool(terminated), bool(truncated), info

    def close(self) -> None:
        self._env.close()


def _check_step_env(name: str, obj: Any) -> None:
    if not callable(obj):
        raise TypeError(f"step environment {name!r}: {obj!r} is not a class or factory")
    for method in ("reset", "step", "spec"):
        if isinstance(obj, type) and not callable(getattr(obj, method, None)):
            raise TypeError(f"step environment {name!r}: class {obj.__qualname__} has no {method}() method "
                            "(see nemo_like.gym.step_env.StepEnvironment)")


# Tests and notebooks keep their registrations local with ``with STEP_ENV_REGISTRY.isolated(): ...``.
STEP_ENV_REGISTRY: Registry[Any] = Registry("step environment", check=_check_step_env, builtins={
    "Catch-v0": "nemo_like.gym.catch.CatchEnvironment",
})


def register_step_env(name: str, cls_or_import_path: Any = None, *, overwrite: bool = False) -> Any:
    """Register a StepEnvironment class (or factory, or import path) under ``name``; usable as a
    decorator. The name then works as ``env.id`` in a gym GRPO config."""
    return STEP_ENV_REGISTRY.register(name, cls_or_import_path, overwrite=overwrite)


def _gymnasium_ids() -> list[str]:
    import gymnasium

    return list(gymnasium.registry)


def check_step_env_name(name: str) -> None:
    """KeyError naming the registered and the closest gymnasium ids unless ``name`` resolves; for
    config validation, before Ray starts (imports nothing but gymnasium's registry)."""
    if name in STEP_ENV_REGISTRY or name in _gymnasium_ids():
        return
    known = STEP_ENV_REGISTRY.names()
    close = difflib.get_close_matches(name, known + _gymnasium_ids(), n=3)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    raise KeyError(f"unknown step environment {name!r}{hint}: register a class with "
                   f"register_step_env({name!r}, MyEnv) or use a gymnasium id; registered: {known}")


def step_env_factory(name: str) -> Callable[..., StepEnvironment]:
    """What builds the environment ``name``: the registered class (or factory), else a gymnasium
    wrapper. Resolved in the driver and sent to the collector actors as an object, so a class
    registered in a notebook or a script works there too (a fresh actor process has only the
    built-in registrations)."""
    if name in STEP_ENV_REGISTRY:
        return STEP_ENV_REGISTRY.get(name)
    check_step_env_name(name)
    return functools.partial(GymnasiumEnvironment, name)


def make_step_env(name: str | Callable[..., StepEnvironment], max_episode_steps: int | None = None,
                  **kwargs: Any) -> StepEnvironment:
    """A fresh instance of the environment ``name`` (registered, else a gymnasium id), or of what
    :func:`step_env_factory` returned."""
    factory = step_env_factory(name) if isinstance(name, str) else name
    extra = {"max_episode_steps": max_episode_steps} if max_episode_steps else {}
    return factory(**extra, **kwargs)
