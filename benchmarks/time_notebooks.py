"""Wall time of each notebook as a user runs it (its own settings, not the test suite's tiny ones), in a
real Jupyter kernel, one after another; prints a table.

    uv run benchmarks/time_notebooks.py [NAME.ipynb ...]

Runs write under results/notebook_timing/ (NEMO_LIKE_NB_RUN_DIR); the tiny base model is built on first
use (about 3 minutes, not counted in a later run's time once it is cached).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def main(names: list[str]) -> int:
    paths = [ROOT / "notebooks" / n for n in names] if names else sorted((ROOT / "notebooks").glob("*.ipynb"))
    rows = []
    for path in paths:
        os.environ["NEMO_LIKE_NB_RUN_DIR"] = str(ROOT / "results" / "notebook_timing" / path.stem)
        nb = nbformat.read(path, as_version=4)
        t0 = time.perf_counter()
        try:
            NotebookClient(nb, timeout=1800, kernel_name="python3",
                           resources={"metadata": {"path": str(path.parent)}}).execute()
            status = "ok"
        except Exception as e:  # a failing cell: report it, time the rest
            status = f"failed: {type(e).__name__}"
        rows.append((path.name, time.perf_counter() - t0, status))
        print(f"{path.name}: {rows[-1][1]:.0f} s {status}", file=sys.stderr, flush=True)
    print("| notebook | wall s | |\n|---|---:|---|")
    for name, seconds, status in rows:
        print(f"| {name} | {seconds:.0f} | {status} |")
    return 0 if all(s == "ok" for _, _, s in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
