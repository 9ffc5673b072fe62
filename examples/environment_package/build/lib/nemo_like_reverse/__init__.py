"""An example environment package for nemo_like (see README.md)."""

from nemo_like_reverse.environment import ReverseTextConfig, ReverseTextEnvironment

__all__ = ["ReverseTextConfig", "ReverseTextEnvironment"]
