"""nemo_like: environment-centric GRPO post-training that runs and learns on a laptop CPU."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["GRPOExperiment", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import nemo_like` must stay cheap (Ray workers import the package on start-up).
    if name == "GRPOExperiment":
        from nemo_like.experiment import GRPOExperiment

        return GRPOExperiment
    raise AttributeError(f"module 'nemo_like' has no attribute {name!r}")
