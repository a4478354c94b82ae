"""The model a plan is for, from whatever the user has: a preset's name, a Hugging Face
`config.json` (or its directory) or a GGUF file. Shapes only: no weights are read, no torch is
imported.

A GGUF file's header is parsed here rather than by `gguf.GGUFReader`, which indexes every
element of the tokenizer's arrays on opening (about 20 s for Gemma 3's 262,144 tokens on this
machine); the header alone is a fraction of a second. `lifeline.model.config` turns it into a
config exactly as the loader does (`config_from_gguf_header`).
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from lifeline.model import registry
from lifeline.model.config import ModelConfig, config_from_gguf_header, config_from_hf
from lifeline.model.presets import PRESETS, preset_config


def load_plan_model(spec: str) -> ModelConfig:
    """A preset (`lifeline.model.presets.PRESETS`), a model Lifeline names
    (`gemma-3-270m`, `smollm2-135m-instruct`), a Hugging Face `config.json` or a directory
    holding one, or a `.gguf` file. ValueError for anything else, or for an architecture
    Lifeline cannot count the parameters of."""
    cfg = _load(spec)
    registry.family(cfg.architecture)  # ValueError naming the supported ones
    return cfg


def _load(spec: str) -> ModelConfig:
    if spec in PRESETS:
        return preset_config(spec)
    path = Path(spec).expanduser()
    if not path.exists():
        from lifeline.model.default import ModelNotInstalled, named_model_path

        try:
            path = named_model_path(spec) or path
        except ModelNotInstalled as e:
            raise ValueError(str(e)) from None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json (a Hugging Face model directory has)")
        return _from_hf(path)
    if path.is_file() and path.suffix == ".gguf":
        return config_from_gguf_header(*read_gguf_header(path))
    if path.is_file() and path.suffix == ".json":
        return _from_hf(path)
    raise ValueError(f"no model {spec!r}: give a preset ({', '.join(sorted(PRESETS))}), a "
                     "Hugging Face config.json or its directory, or a .gguf file")


def _from_hf(path: Path) -> ModelConfig:
    try:
        return config_from_hf(path)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a Hugging Face model config ({e!r})") from None


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
"""GGUF metadata value types and their `struct` formats; 8 is a string, 9 an array."""
_STRING, _ARRAY = 8, 9
_SKIPPED = "tokenizer."
"""Metadata the planner does not read: the vocabulary, scores, merges and chat template."""


def read_gguf_header(path: str | Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """The metadata (all but `tokenizer.*`) and every tensor's shape, in torch order (GGUF's
    [ne0, ne1] is [ne1, ne0]), of a GGUF file (version 2 or 3, either byte order); no tensor
    data is read."""
    with open(path, "rb") as file:
        if file.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        buf = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    with buf:
        try:
            return _Header(buf).read()
        except (struct.error, IndexError, UnicodeDecodeError, KeyError) as e:
            raise ValueError(f"{path}: truncated or corrupt GGUF header ({e})") from None


class _Header:
    def __init__(self, buf: mmap.mmap):
        self.buf = buf
        version = struct.unpack_from("<I", buf, 4)[0]
        self.order = ">" if version & 0xFFFF == 0 else "<"  # a big-endian file's version
        if struct.unpack_from(self.order + "I", buf, 4)[0] < 2:
            raise ValueError("GGUF version 1 is not supported")
        self.pos = 8

    def read(self) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
        num_tensors, num_values = self.unpack("QQ")
        metadata = {}
        for _ in range(num_values):
            key = self.string()
            value = self.value(self.unpack("I")[0], skip=key.startswith(_SKIPPED))
            if not key.startswith(_SKIPPED):
                metadata[key] = value
        shapes = {}
        for _ in range(num_tensors):
            name = self.string()
            dims = self.unpack(f"{self.unpack('I')[0]}Q")
            self.unpack("IQ")  # type, offset
            shapes[name] = tuple(reversed(dims))
        return metadata, shapes

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        fmt = self.order + fmt
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self, skip: bool = False) -> str:
        size = self.unpack("Q")[0]
        start, self.pos = self.pos, self.pos + size
        if self.pos > len(self.buf):
            raise IndexError("string past the end of the file")
        return "" if skip else self.buf[start:self.pos].decode("utf-8")

    def value(self, kind: int, skip: bool = False) -> Any:
        if kind == _STRING:
            return self.string(skip)
        if kind != _ARRAY:
            return self.unpack(_SCALARS[kind])[0]
        kind, count = self.unpack("IQ")
        if kind in _SCALARS and skip:
            self.pos += count * struct.calcsize(_SCALARS[kind])
            return None
        if kind in _SCALARS:
            return list(self.unpack(f"{count}{_SCALARS[kind]}"))
        values = [self.value(kind, skip) for _ in range(count)]
        return None if skip else values
