"""Lifeline's C++ operators for the CPU (lifeline/csrc/cpu_ops.cpp), built on first use:

- `lifeline_ext::int8_linear`: fbgemm's int8 GEMM by layer handle, for compiled code
  (lifeline/model/compiled.py), without a round trip through Python on each call.
- `lifeline_ext::decode_attention`: decode attention read straight from the paged KV cache
  (lifeline/model/layers/attention.py), without copying each context out first.

Built once per machine and PyTorch with the system's C++ compiler and ninja (PyTorch caches
the library under ~/.cache/torch_extensions). Where it cannot be built, the
callers keep their pure-PyTorch paths: slower, not different (tests/test_native_ops.py holds
the two to the same results)."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCE = CSRC / "cpu_ops.cpp"
GGUF_SOURCE = CSRC / "gguf_ops.cpp"
_lock = threading.Lock()


FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
"""`-fno-trapping-math`: without it GCC 12 leaves the attention's exp, max and sum loops scalar
("control flow in loop"); nothing here reads floating-point exception flags."""
GGUF_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]
"""The GGUF kernels are built for any x86-64 CPU: each SIMD kernel carries its own target
attribute and is chosen at run time by what the CPU reports, so a library built on one machine
never runs an instruction another lacks. `-fopenmp` for `at::parallel_for`, whose OpenMP
runtime is PyTorch's own (the same `libgomp.so.1`, loaded first)."""
_BUILD = """
import json, sys
from torch.utils import cpp_extension
name, source, flags = sys.argv[1:]
cpp_extension.load(name, [source], extra_cflags=json.loads(flags), is_python_module=False)
print(cpp_extension._get_build_directory(name, False))
"""


def _staged_source(source: Path = SOURCE, flags: list[str] = FLAGS,
                   prefix: str = "lifeline_cpu_ops") -> tuple[str, Path]:
    """The library's name and a copy of its source, both keyed by the source's content.

    PyTorch keeps one build directory per name and rebuilds when the source's path changes, so
    two checkouts of Lifeline (worktrees, a CI clone beside a dev tree) that built from their own
    paths would rebuild each other's library on every switch, and two building at once would
    share one directory. A content-keyed name and path give each version of the source its own
    build, shared by every checkout that has it."""
    text = source.read_bytes()
    digest = hashlib.sha256(text + repr(flags).encode()).hexdigest()[:12]
    name = f"{prefix}_{digest}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR")
                or Path.home() / ".cache" / "torch_extensions") / "lifeline_sources"
    root.mkdir(parents=True, exist_ok=True)
    staged = root / f"{name}.cpp"
    if not staged.exists() or staged.read_bytes() != text:
        partial = staged.with_suffix(f".{os.getpid()}.tmp")
        partial.write_bytes(text)
        partial.replace(staged)  # atomic: a concurrent builder never reads half a file
    return name, staged


def _load(source: Path, flags: list[str], prefix: str) -> bool:
    """Build (or find built) and load one source's library; False, with a warning, where it
    cannot be built."""
    with _lock:
        try:
            name, staged = _staged_source(source, flags, prefix)
            library = _built_library(name)
            if library is None:
                built = subprocess.run(
                    [sys.executable, "-c", _BUILD, name, str(staged), json.dumps(flags)],
                    check=True, capture_output=True, text=True, timeout=600)
                library = Path(built.stdout.strip().splitlines()[-1]) / f"{name}.so"
            torch.ops.load_library(str(library))
        except (RuntimeError, OSError, IndexError, subprocess.SubprocessError) as exc:
            # no compiler, no headers, no ninja
            detail = getattr(exc, "stderr", None) or exc
            warnings.warn(f"Lifeline's C++ operators ({source.name}) were not built "
                          f"({str(detail)[-2000:]}); using the PyTorch paths", stacklevel=3)
            return False
    return True


def _built_library(name: str) -> Path | None:
    """The library a previous build left for `name`, where one is there and its source is
    the staged one it was built from: the name is keyed by the source's content and the
    flags, so a library of that name is current, and the build subprocess (~1.4 s of
    PyTorch's import and ninja's check) is skipped."""
    from torch.utils import cpp_extension

    library = Path(cpp_extension._get_build_directory(name, False)) / f"{name}.so"
    return library if library.is_file() else None


@functools.cache
def native_ops() -> bool:
    """Whether `torch.ops.lifeline_ext` is loaded (building it now if needed); False, with a
    warning, where it cannot be built.

    The build (or the check that the cached build is current) runs in a child process, which
    prints where the library is; this process only loads it. Run here, `cpp_extension.load`
    left PyTorch's own parallel kernels several times slower for the rest of the process
    (docs/performance.md; loading the built library alone changes nothing)."""
    return _load(SOURCE, FLAGS, "lifeline_cpu_ops") and hasattr(torch.ops.lifeline_ext,
                                                                "decode_attention")


@functools.cache
def gguf_ops() -> bool:
    """Whether `torch.ops.lifeline_gguf` (lifeline/csrc/gguf_ops.cpp: matrix products and row
    lookups straight from GGUF's quantized blocks) is loaded, building it if needed."""
    return _load(GGUF_SOURCE, GGUF_FLAGS, "lifeline_gguf_ops") and hasattr(
        torch.ops.lifeline_gguf, "gguf_linear")
