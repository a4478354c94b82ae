"""The GGUF tokenizers a load keeps on disk (lifeline/tokenizer/cache.py): a second load of the
same file takes the kept one and steps over the header's vocabulary arrays, and what it gets
encodes as transformers does (Gemma 3) and as the freshly built one does (both real models); a
damaged entry is built again and rewritten, a changed file misses, and the cache can be off."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from lifeline.model.default import default_model_path, smollm2_model_path
from lifeline.model.gguf_file import TOKENIZER_ARRAYS, CorruptGGUF, GGUFFile
from lifeline.model.loader import load_model
from lifeline.tokenizer.cache import cached_tokenizer
from tests.test_tokenizer import CASES


def _entries(root: Path) -> list[Path]:
    return sorted((root / "tokenizers").glob("*.pkl"))


def _same_tokenizer(kept, built) -> None:
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "add_bos", "vocab_size",
                 "special_token_ids", "eos_token_ids"):
        assert getattr(kept, name) == getattr(built, name), name
    for text in CASES:
        ids = built.encode(text)
        assert kept.encode(text) == ids, text
        assert kept.encode(text, add_special_tokens=False) == built.encode(
            text, add_special_tokens=False), text
        assert kept.decode(ids) == built.decode(ids), text


@pytest.mark.parametrize("which", ["gemma", "smollm2"])
def test_a_second_load_takes_the_kept_tokenizer(which, hf_gemma_tokenizer, tmp_path,
                                                 monkeypatch):
    monkeypatch.setenv("LIFELINE_CACHE_DIR", str(tmp_path))
    path = default_model_path() if which == "gemma" else smollm2_model_path()
    built = load_model(path, lazy=True).tokenizer
    assert len(_entries(tmp_path)) == 1
    kept = cached_tokenizer(path)
    assert kept is not None and kept is not built
    second = load_model(path, lazy=True).tokenizer
    assert type(second) is type(built) and second is not built
    _same_tokenizer(second, built)
    _same_tokenizer(second, built)  # twice: a BPE's per-instance word cache, rebuilt empty
    if which == "gemma":
        for text in CASES:
            if "\u2581" not in text and " " * 32 not in text:  # tests/test_tokenizer.py's
                assert second.encode(text) == hf_gemma_tokenizer.encode(text), text


def test_skipping_the_vocabulary_arrays_reads_the_rest_of_the_header_the_same():
    path = default_model_path()
    whole, skipped = GGUFFile(path), GGUFFile(path, skip_tokenizer=True)
    assert skipped.metadata == whole.metadata
    assert not TOKENIZER_ARRAYS & skipped.reader.fields.keys()
    assert "tokenizer.ggml.tokens" in whole.reader.fields
    assert skipped.tensor_names == whole.tensor_names
    for name in whole.tensor_names:
        a, b = whole.raw(name), skipped.raw(name)
        assert (a[1], a[2]) == (b[1], b[2]) and a[0].ctypes.data - whole.reader.data.ctypes.data \
            == b[0].ctypes.data - skipped.reader.data.ctypes.data, name


def test_a_file_cut_inside_its_vocabulary_is_refused_when_skipped_too(tmp_path):
    data = smollm2_model_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:200_000])  # inside the 49,152 token strings
    for skip in (False, True):
        with pytest.raises(CorruptGGUF, match="truncated or corrupt GGUF"):
            GGUFFile(cut, skip_tokenizer=skip)


def test_a_damaged_entry_is_built_again_and_a_changed_file_misses(tmp_path, monkeypatch):
    monkeypatch.setenv("LIFELINE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(smollm2_model_path().read_bytes())
    built = load_model(path, lazy=True).tokenizer
    (entry,) = _entries(tmp_path / "cache")
    entry.write_bytes(entry.read_bytes()[:1000])  # cut short
    assert cached_tokenizer(path) is None
    again = load_model(path, lazy=True).tokenizer
    _same_tokenizer(again, built)
    assert cached_tokenizer(path) is not None  # written again, whole
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert cached_tokenizer(path) is None  # the file changed: another key


def test_the_cache_can_be_off(tmp_path, monkeypatch):
    monkeypatch.setenv("LIFELINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LIFELINE_TOKENIZER_CACHE", "0")
    load_model(smollm2_model_path(), lazy=True)
    assert not (tmp_path / "tokenizers").exists()
    assert cached_tokenizer(smollm2_model_path()) is None
