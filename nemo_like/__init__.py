"""nemo_like: environment-centric GRPO post-training that runs and learns on a laptop CPU."""

import os
from typing import Any

__version__ = "0.1.0"

# NEMO_LIKE_STACKS_ON_SIGUSR1=1: every process that imports the package (the driver, each Ray worker
# and environment actor) prints all its threads' Python stacks to stderr on SIGUSR1, so a run that
# hangs can be asked where it is without a debugger (the stall watch does, distributed/stall.py, and
# benchmarks/device/acceptance.sh before its time limit kills a check). The processes of a local Ray
# cluster the driver starts have it set (unless the driver's environment sets it to 0), and leave
# their pid in NEMO_LIKE_STACKS_DIR, so the driver knows whom to ask.
if os.environ.get("NEMO_LIKE_STACKS_ON_SIGUSR1") == "1":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if os.environ.get("NEMO_LIKE_STACKS_DIR"):
        from nemo_like._proc import process_start_time

        try:  # the pid, and the start time that tells this process from a later one with its pid
            with open(os.path.join(os.environ["NEMO_LIKE_STACKS_DIR"], str(os.getpid())), "w") as f:
                f.write(process_start_time() or "")
        except OSError:  # the folder is gone (its cluster stopped): nobody will ask
            pass
__all__ = ["GRPOExperiment", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import nemo_like` must stay cheap (Ray workers import the package on start-up).
    if name == "GRPOExperiment":
        from nemo_like.experiment import GRPOExperiment

        return GRPOExperiment
    raise AttributeError(f"module 'nemo_like' has no attribute {name!r}")
