"""The critic (value model) for PPO: its config, its Ray worker and the driver-side facade."""

from nemo_like.models.critic.config import CriticConfig

__all__ = ["CriticConfig", "Critic"]


def __getattr__(name):
    # Critic pulls in Ray and torch; keep `import nemo_like.models.critic` light for config validation.
    if name == "Critic":
        from nemo_like.models.critic.critic import Critic

        return Critic
    raise AttributeError(name)
