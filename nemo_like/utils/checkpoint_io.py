"""What makes a checkpoint exact or refused: a manifest of its files and a train state that loads
without executing code.

* ``manifest.json`` is written last into a checkpoint (atomically: temp file, fsync, os.replace) and
  lists every file with its size, plus a sha256 for files small enough to hash in passing.
  ``checkpoint_problems`` compares a directory against it: a file deleted, truncated, rewritten or
  added after the save is named, and a directory without a manifest is not a checkpoint.
* ``train_state.pt`` holds tensors and plain types only (RNG states converted), so it is read with
  ``torch.load(weights_only=True)``: loading a checkpoint never runs code stored in it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.pt"
# Bumped when the train state's layout changes; older train states are refused by name, not half-read.
TRAIN_STATE_FORMAT = 2
# Files up to this size also get a sha256; bigger ones (model shards, optimizer state of a real model)
# only their size, so neither a save nor a resume spends seconds hashing gigabytes. Truncation and
# deletion, what a crash or a partial copy does, show in the size.
HASH_MAX_BYTES = 64 << 20

# Fault injection for the crash tests: a test's child process sets this to be killed at a named point
# of a save (see ``reached``). None in every real run.
FAULT_HOOK: Callable[[str], None] | None = None


class CheckpointError(RuntimeError):
    """A checkpoint (or checkpoint directory) that cannot be used as it is; the message says why."""


def reached(point: str) -> None:
    """Marks a named point of a save for ``FAULT_HOOK``."""
    if FAULT_HOOK is not None:
        FAULT_HOOK(point)


def fsync_path(path: Path) -> None:
    # Directories need an fsync too, or a rename/create inside them may not survive a power cut.
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() and hasattr(os, "O_DIRECTORY") else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return  # e.g. platforms that cannot open directories; best effort
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(root: Path) -> dict[str, Path]:
    """Every regular file under ``root`` by its relative posix name (symlinked dirs not followed)."""
    out = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = Path(dirpath) / name
            out[p.relative_to(root).as_posix()] = p
    return out


def write_manifest(root: Path, step: int) -> None:
    """Lists every file under ``root`` (sizes, sha256 of small ones) in ``root/manifest.json``."""
    files = {}
    for rel, p in sorted(_files(root).items()):
        if rel in (MANIFEST, MANIFEST + ".tmp"):
            continue
        size = p.stat().st_size
        files[rel] = {"size": size} | ({"sha256": _sha256(p)} if size <= HASH_MAX_BYTES else {})
    tmp = root / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": 1, "step": step, "files": files}, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)
    fsync_path(root)


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of ``root``; CheckpointError when it is missing or malformed."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"no {MANIFEST} (an unfinished save, or one written before nemo_like kept manifests)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{MANIFEST} is unreadable: {e}") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("size"), int) for e in files.values()):
        raise CheckpointError(f"{MANIFEST} is malformed: expected {{'files': {{name: {{'size': int, ...}}}}}}")
    return data


def checkpoint_problems(root: str | os.PathLike[str]) -> list[str]:
    """What is wrong with the checkpoint at ``root`` against its manifest; empty when it is intact."""
    root = Path(root)
    if not root.is_dir():
        return [f"{root} is not a directory"]
    try:
        files = read_manifest(root)["files"]
    except CheckpointError as e:
        return [str(e)]
    problems = []
    for rel, entry in files.items():
        p = root / rel
        if not p.is_file():
            problems.append(f"{rel} is missing")
        elif (size := p.stat().st_size) != entry["size"]:
            problems.append(f"{rel} has {size} bytes, the manifest says {entry['size']}")
        elif "sha256" in entry and _sha256(p) != entry["sha256"]:
            problems.append(f"{rel} differs from the file that was saved (sha256)")
    # A file nobody saved would be loaded too (e.g. a stray *.safetensors shard): refuse it. Hidden
    # files (.nfs*, editor droppings) are not something the loaders read.
    for rel in sorted(_files(root)):
        if rel not in files and rel != MANIFEST and not any(part.startswith(".") for part in rel.split("/")):
            problems.append(f"{rel} is not in the manifest")
    return problems


def verify_checkpoint(root: str | os.PathLike[str]) -> None:
    """Raises CheckpointError naming every problem of the checkpoint at ``root``."""
    problems = checkpoint_problems(root)
    if problems:
        raise CheckpointError(f"checkpoint {root} is damaged or incomplete: {'; '.join(problems)}")


# ---- train state --------------------------------------------------------------------------------
def capture_rng() -> dict[str, Any]:
    """Python, numpy and torch (CPU) RNG states as tensors and plain types."""
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {"python": [int(version), [int(x) for x in internal], gauss_next],
            "numpy": [str(name), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                      float(cached)],
            "torch": torch.get_rng_state()}


def restore_rng(state: Mapping[str, Any]) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss_next))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])


def _check_plain(value: Any, where: str) -> None:
    """Refuses, at save time, anything ``torch.load(weights_only=True)`` would refuse at resume."""
    if value is None or isinstance(value, bool | int | float | str | torch.Tensor):
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str | int):
                raise TypeError(f"train state {where}: key {k!r} is a {type(k).__name__}, not a str or int")
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise TypeError(f"train state {where} is a {type(value).__name__}: only tensors, None, bool, int, float, "
                    "str, lists and dicts of them load without executing code")


def save_train_state(directory: str | os.PathLike[str], state: Mapping[str, Any]) -> Path:
    """Writes ``state`` plus the current RNG states to ``directory/train_state.pt``."""
    reached("train_state")
    full = {"format": TRAIN_STATE_FORMAT, **state, "rng": capture_rng()}
    _check_plain(full, "")
    path = Path(directory) / TRAIN_STATE
    torch.save(full, path)
    reached("train_state_written")
    return path


def load_train_state(directory: str | os.PathLike[str], verify: bool = True) -> dict[str, Any]:
    """Reads ``directory/train_state.pt`` with weights_only=True; CheckpointError if that is not possible.
    With ``verify``, every file of the checkpoint is first checked against its manifest."""
    if verify:
        verify_checkpoint(directory)
    path = Path(directory) / TRAIN_STATE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} does not load as tensors and plain types (damaged, or written by an "
                              f"older nemo_like that pickled Python objects): {first}") from None
    if not isinstance(state, dict) or state.get("format") != TRAIN_STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path}: train state format {found!r}, this nemo_like reads {TRAIN_STATE_FORMAT}")
    return state


def load_full_training_state(model: torch.nn.Module, sd: Mapping[str, torch.Tensor], where: str, what: str,
                             optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                             optim_file: Path | None = None) -> None:
    """Exactly ``sd`` (whole tensors) into ``model``, sharded or not: RuntimeError naming missing and
    unexpected weights first; then, when ``optim_file`` exists, the optimizer and scheduler state saved
    beside it (``{"optimizer": full optimizer state dict, "scheduler": ...}``)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise RuntimeError(f"{where}: the checkpoint's weights do not match the {what}: missing {missing[:10]}, "
                           f"unexpected {unexpected[:10]}")
    opts = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, dict(sd), options=opts)
    if optimizer is not None and optim_file is not None and optim_file.exists():
        st = torch.load(optim_file, weights_only=True, map_location="cpu")
        set_optimizer_state_dict(model, optimizer, st["optimizer"], options=opts)
        scheduler.load_state_dict(st["scheduler"])
