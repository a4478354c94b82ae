"""The model a plan is for, from whatever the user has: a preset's name, a Hugging Face
`config.json` (or its directory) or a GGUF file. Shapes only: no weights are read, no torch is
imported.

A GGUF file's header is read by `lifeline.model.gguf_reader`, its tokenizer arrays stepped
over (gguf-py's reader indexes every element of them: about 20 s for Gemma 3's 262,144 tokens);
the header alone is a fraction of a second. `lifeline.model.config` turns it into a
config exactly as the loader does (`config_from_gguf_header`).
"""
from __future__ import annotations

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


def read_gguf_header(path: str | Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """The metadata (all but `tokenizer.*`) and every tensor's shape, in torch order (GGUF's
    [ne0, ne1] is [ne1, ne0]), of a GGUF file (version 2 or 3, either byte order); no tensor
    data is read."""
    from lifeline.model.gguf_reader import GGUFReader

    with open(path, "rb") as file:
        if file.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
    try:
        reader = GGUFReader(str(path), skip=("tokenizer.",))
    except (ValueError, struct.error, IndexError, OverflowError) as e:
        raise ValueError(f"{path}: truncated or corrupt GGUF header ({e})") from None
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors}
    return metadata, shapes
