"""Progress bars only where a person watches a terminal.

A log file, a Slurm job or CI captures carriage returns literally: a tqdm bar redrawn there
interleaves with the per-step lines on one line (``\\rGRPO: 0%|...|\\r   \\rstep 1 ...``). Off a
terminal the bar is off and the per-step lines (and ``progress_write``) are plain lines.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from tqdm.auto import tqdm

# "bar" or "plain" forces one; anything else (or unset): a bar only when stdout and stderr are terminals.
PROGRESS_ENV = "NEMO_LIKE_PROGRESS"


def bar_wanted() -> bool:
    forced = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if forced in ("bar", "plain"):
        return forced == "bar"
    if "ipykernel" in sys.modules:  # a notebook: tqdm.auto draws its widget there, never a redraw in text
        return True
    # Both: the bar draws on stderr, the lines go to stdout; with either one captured the two
    # streams interleave where a reader sees them.
    return _isatty(sys.stdout) and _isatty(sys.stderr)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def quiet_library_bars() -> None:
    """Off a terminal, the libraries' own bars (datasets' "Generating train split", transformers'
    "Loading weights", the hub's downloads) go too: each would leave its redraws run together on one line.
    (Ray workers never draw theirs: distributed.ray_cluster turns them off in the workers' environment.)"""
    if bar_wanted():
        return
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when huggingface_hub is first imported
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    import datasets
    import transformers

    datasets.disable_progress_bars()  # already imported: their switches, not the variables, decide
    transformers.utils.logging.disable_progress_bar()


def progress_bar(iterable: Any = None, **kwargs: Any) -> tqdm:
    """A tqdm bar that is drawn in a terminal and silent elsewhere (it still counts)."""
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("mininterval", 0.1)
    return tqdm(iterable, disable=not bar_wanted(), **kwargs)


def progress_write(text: str) -> None:
    """A line above a live bar (tqdm.write), or a plain line when there is none."""
    tqdm.write(text)
