"""The model's forward pass through `torch.compile` (`EngineConfig(compile=True)`, `lifeline
serve`'s default).

In eager mode a decode step of one request is hundreds of small kernels (norms, RoPE, residual
adds, GeGLU), each paying PyTorch's dispatch, for a few hundred floats of work; Inductor fuses
them into a few C++ loops (docs/performance.md, "Compiled forward"). Two parts of a step stay
opaque to the compiler, as custom operators:

- `lifeline::int8_linear`: fbgemm's int8 GEMM takes its packed weights as a TorchScript object,
  which Dynamo cannot trace; the operator takes the layer's handle instead (in C++ where
  lifeline/model/native.py could build it: `lifeline_ext::int8_linear`). The activations'
  rotation and per-row scales around it stay in the graph (`Int8Linear._traced_int8_matmul`).
  Only lone rows take it: batches go through oneDNN's int8 GEMM, which takes plain tensors and
  is traced whole (Inductor calls it as a fallback kernel: `_onednn_int8_as_is`).
- `lifeline::paged_attention` (lifeline/model/layers/attention.py): attention reads the step's
  KV pools and layout from the forward context, in compiled mode as in eager.

The compiled function has the model's own signature, `(input_ids, positions)`, and runs inside
the same forward context the eager model does; nothing here is specific to a model family.
Shapes are dynamic in the token count, so one graph serves every batch and chunk size from 2
tokens up; Dynamo specializes a step of one token (a lone decode) into a graph of its own.
Guards on module attributes are skipped: the compiled function belongs to one model whose
structure does not change after `compile_forward`.

**An on-disk cache of compiled graphs.** Tracing the model with Dynamo is most of a compiled
start (docs/performance.md, "Start-up"), and Dynamo's own caches keep only what comes after the
trace. So each of the two graphs (one token; every count from 2 up) is compiled ahead of time
(`torch.compile(...).aot_compile`: the trace, the guards and Inductor's code, serializable) and
saved under `compile_cache_dir()`, keyed by everything that changes it (`cache_key`: this
format, PyTorch and Python, the CPU's features and PyTorch's thread count, Lifeline's model
sources and C++ operators, the model's configuration, module tree and tensor shapes). A later
start of any model with the same key loads the graphs instead of tracing them: the graph reads
weights, int8 handles (one-element tensors) and the KV pools as inputs, and bakes in only what
the key names. Two processes starting at once take a lock per file: one compiles and writes
(atomically), the other then loads. A file that cannot be read or belongs to another setup is
compiled again and replaced; a model whose forward does not trace as one graph compiles in
process as before. `LIFELINE_CACHE_DIR` moves the cache (default `~/.cache/lifeline`),
`LIFELINE_COMPILE_CACHE=0` turns it off; Inductor's own cache (the built kernels the saved code
loads) goes under the same directory unless `TORCHINDUCTOR_CACHE_DIR` is set.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lifeline.model.native import native_ops
from lifeline.model.layers.attention import PagedAttention, compiled_attention_op
from lifeline.model.layers.rotary import build_tables, native_rows
from lifeline.model.registry import family_of

log = logging.getLogger(__name__)


_DYNAMO_IMPORT = threading.Lock()


def _before_dynamo() -> None:
    """What the first compile or load of a graph in this process needs first: its compiles
    counted (lifeline.engine.startup) and oneDNN's int8 GEMM left as it is. One thread at a
    time: two threads importing Dynamo at once (two backends loading their graphs) meet its
    circular imports half done ("cannot import name ... from partially initialized module")."""
    from lifeline.engine.startup import count_compiles

    with _DYNAMO_IMPORT:
        count_compiles()
        _onednn_int8_as_is()


@functools.cache
def _onednn_int8_as_is() -> None:
    """Have Inductor call oneDNN's int8 GEMM as it is (a fallback kernel) instead of lowering
    it: its lowering expects the packed weights as constants of a frozen graph
    (`freezing=True`, which our lifted module attributes are not). Called before the first
    compile or load, not at import: Inductor's lowerings take seconds to import, which a
    server that serves eagerly until its graphs load need not spend before `/ready`."""
    if not hasattr(torch.ops.onednn, "qlinear_pointwise"):
        return
    from torch._inductor import lowering, mkldnn_lowerings  # noqa: F401 (registers the lowering)

    op = torch.ops.onednn.qlinear_pointwise.default
    lowering.lowerings.pop(op, None)
    lowering.make_fallback(op, warn=False)

_LIB = torch.library.Library("lifeline", "FRAGMENT")
_LIB.define("int8_linear(Tensor x, Tensor handle, int out_features) -> Tensor")

_GEMMS: dict[int, tuple[Any, bool, int]] = {}
"""handle -> (fbgemm's packed weights, reduce_range, out_features) of a live int8 layer."""
_linear_dynamic = torch.ops.quantized.linear_dynamic.default
_next_handle = iter(range(1 << 62))


def _int8_linear(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    packed, reduce_range, _ = _GEMMS[int(handle)]  # a dict lookup, no module attribute lookups
    return _linear_dynamic(x, packed, reduce_range)


def _int8_linear_meta(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


# Library.impl rather than torch.library.custom_op: its dispatch costs less per call
_LIB.impl("int8_linear", _int8_linear, "CPU")
_LIB.impl("int8_linear", _int8_linear_meta, "Meta")


_EXT = torch.library.Library("lifeline_ext", "IMPL")


@functools.cache
def native_int8_linear() -> bool:
    """Whether `lifeline_ext::int8_linear` (lifeline/model/native.py) is there: the same GEMM
    as `lifeline::int8_linear` without a round trip through Python on each call (at batch 1,
    one per projection and the head, every step)."""
    if not native_ops():
        return False
    _EXT.impl("int8_linear", _int8_linear_meta, "Meta")
    return True


def int8_linear_op() -> Any:
    """The operator compiled code calls fbgemm's GEMM through: the C++ one where built."""
    return torch.ops.lifeline_ext.int8_linear if native_int8_linear() else torch.ops.lifeline.int8_linear


def register_int8_linear(module: nn.Module) -> int:
    """A handle by which compiled code calls fbgemm's GEMM with `module`'s packed weights
    (`int8_linear_op()`); it lives as long as the module does."""
    handle = next(_next_handle)
    _GEMMS[handle] = (module.packed, module.reduce_range, module.out_features)
    weakref.finalize(module, _GEMMS.pop, handle, None)
    if native_int8_linear():
        torch.ops.lifeline_ext.register_gemm(handle, module.packed, module.reduce_range)
        weakref.finalize(module, torch.ops.lifeline_ext.unregister_gemm, handle)
    return handle


def supports_compile(model: nn.Module) -> bool:
    """Whether the model's family declares that its forward compiles (lifeline.model.registry)."""
    return family_of(model).compiles


def compile_forward(model: nn.Module, identity: str = ""
                    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`model(input_ids, positions)` as a compiled function of the same signature, called
    inside the step's forward context. Int8 layers get handles; the first calls of each shape
    class compile, or load from the on-disk cache (`warmup` runs them). `identity`: what else
    the graphs depend on that the model does not show (the runner passes its model
    configuration), for the cache's key."""
    if not supports_compile(model):
        raise ValueError(f"{type(model).__name__} does not support compile")
    if not native_rows():
        build_tables(model)  # compiled code computes no cos or sin of its own
    for module in model.modules():
        if hasattr(module, "int8_matmul") and not module.rescore_top and module.packed is not None:
            module.compile_handle = torch.tensor([register_int8_linear(module)])
            module.compile_op = int8_linear_op()
        if isinstance(module, PagedAttention):
            module.compiled_op = compiled_attention_op()
    forward = model.forward

    def traced(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return forward(input_ids, positions)

    # Dynamo caches graphs by code object and, with module guards skipped, would hand this
    # model a graph traced through another one: each model gets a code object of its own.
    code = traced.__code__.replace(co_name=f"traced_{next(_next_handle)}")
    traced = types.FunctionType(code, traced.__globals__, code.co_name, None, traced.__closure__)
    directory = compile_cache_dir()
    if directory is not None:
        return CachedForward(model, traced, directory / cache_key(model, identity))
    return _in_process(traced)


WRAPPER_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
"""Inductor's generated wrapper checks each operator's output sizes, strides and alignment
at every call, hundreds of Python calls a decode step; the graph's shapes are fixed by the
trace and the operators are ours and PyTorch's, so the checks are left out."""


def _in_process(traced: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`torch.compile` as it comes: Dynamo traces each shape class at its first call."""
    _before_dynamo()
    compiled = torch.compile(traced, dynamic=None, options={
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, **WRAPPER_OPTIONS})

    def run(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(input_ids, 0)
            torch._dynamo.maybe_mark_dynamic(positions, 0)
        return compiled(input_ids, positions)

    return run


CACHE_FORMAT = 1
"""Part of every key: raised when what a saved graph means changes in a way the sources'
digest would not show."""

def _no_guards(entries: list[Any]) -> list[bool]:
    """A cached graph keeps none of Dynamo's guards: those on modules, their attributes and
    Lifeline's module globals are what the key stands for (in process they are skipped too),
    and what a call could change, the token count, is checked by the caller
    (`CachedForward`), which picks the graph by it."""
    return [False] * len(entries)


def compile_cache_dir() -> Path | None:
    """Where compiled graphs are kept: `$LIFELINE_CACHE_DIR/compiled`, by default
    `~/.cache/lifeline/compiled` (`$XDG_CACHE_HOME` where set); None with
    `LIFELINE_COMPILE_CACHE=0`."""
    from lifeline.tokenizer.cache import cache_root

    if os.environ.get("LIFELINE_COMPILE_CACHE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    return cache_root() / "compiled"


@functools.cache
def _sources_digest() -> str:
    """The digest of what traced code runs or bakes in: lifeline/model's Python sources and
    the C++ operators' (their schemas)."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted([*(package / "model").rglob("*.py"), *(package / "csrc").glob("*.cpp")]):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor()


def cache_key(model: nn.Module, identity: str = "") -> str:
    """The key of `model`'s compiled graphs: equal only where a graph traced through one model
    computes another's forward exactly, its weights given as inputs."""
    tensors = [(name, tuple(t.shape), str(t.dtype)) for name, t in
               [*model.named_parameters(), *model.named_buffers()] if t is not None]
    parts = [CACHE_FORMAT, torch.__version__, sys.version, platform.machine(),
             torch.backends.cpu.get_cpu_capability(), _cpu_features(), torch.get_num_threads(),
             native_int8_linear(), _sources_digest(), type(model).__qualname__, identity,
             repr(model), tensors]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


class CachedForward:
    """The compiled forward with its two graphs (one token; 2 and more) loaded from the
    on-disk cache, or compiled ahead of time and saved there, at their first call."""

    def __init__(self, model: nn.Module, traced: Callable[..., torch.Tensor], directory: Path):
        self.model, self.traced, self.directory = model, traced, directory
        # the kernels the saved code loads, beside it (else a load in another process, such
        # as after a background compile, rebuilds them)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(directory.parent / "inductor"))
        self.graphs: dict[bool, Callable[..., torch.Tensor]] = {}
        self.loaded = self.compiled = 0
        """Graphs loaded from the cache and compiled here."""
        self._fallback: Callable[..., torch.Tensor] | None = None

    def cached(self) -> bool:
        """Whether both graphs are in the cache: a first call loads them, compiles nothing."""
        return all((self.directory / name).exists() for name in ("many.pt2", "one.pt2"))

    def preload(self) -> bool:
        """Load both graphs from the cache now (compiling nothing); False where either is
        missing or does not load."""
        graphs = {}
        for many in (True, False):
            fn = self._load(self.directory / ("many.pt2" if many else "one.pt2"))
            if fn is None:
                return False
            graphs[many] = self._guarded(fn)
        self.graphs.update(graphs)
        return True

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        many = input_ids.shape[0] > 1
        graph = self.graphs.get(many)
        if graph is None:
            graph = self.graphs[many] = self._graph(many, input_ids, positions)
        return graph(input_ids, positions)

    def _graph(self, many: bool, input_ids: torch.Tensor, positions: torch.Tensor
               ) -> Callable[..., torch.Tensor]:
        if self._fallback is not None:
            return self._fallback
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / ("many.pt2" if many else "one.pt2")
        with open(self.directory / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process compiling this key: wait, load
            try:
                fn = self._load(path)
                if fn is None:
                    fn = self._compile(many, input_ids, positions, path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        if fn is None:
            self._fallback = _in_process(self.traced)
            return self._fallback
        return self._guarded(fn)

    def _load(self, path: Path) -> Any:
        if not path.exists():
            return None
        _before_dynamo()
        start = time.perf_counter()
        try:
            with path.open("rb") as f:
                fn = torch.compiler.load_compiled_function(
                    f, f_globals=self.traced.__globals__, external_data={"model": self.model})
        except Exception as e:  # noqa: BLE001 (damaged, or another setup's: compile again)
            log.warning("compiled graph %s not loaded (%s: %s); compiling it again", path,
                        type(e).__name__, e)
            return None
        self.loaded += 1
        log.info("compiled graph loaded from %s in %.2f s", path, time.perf_counter() - start)
        return fn

    def _compile(self, many: bool, input_ids: torch.Tensor, positions: torch.Tensor,
                 path: Path) -> Any:
        from lifeline.engine.startup import note_compile

        _before_dynamo()
        start = time.perf_counter()
        if many:
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        compiled = torch.compile(self.traced, fullgraph=True, dynamic=None,
                                 options={"guard_filter_fn": _no_guards, **WRAPPER_OPTIONS})
        try:
            fn = compiled.aot_compile(((input_ids, positions), {}))
        except Exception as e:  # noqa: BLE001 (a graph break, an unserializable part)
            log.warning("the forward does not compile ahead of time as one graph (%s: %s); "
                        "compiling in process, nothing cached", type(e).__name__, e)
            return None
        note_compile()
        self.compiled += 1
        try:
            fn.save_compiled_function(str(path), external_data={"model": self.model})
        except Exception as e:  # noqa: BLE001 (a full disk, a read-only cache: run uncached)
            log.warning("compiled graph not saved to %s (%s: %s)", path, type(e).__name__, e)
        log.info("graph compiled in %.1f s, saved to %s", time.perf_counter() - start, path)
        return fn

    def _guarded(self, fn: Any) -> Callable[..., torch.Tensor]:
        """`fn`, run without Dynamo's guard check (none were kept, `_no_guards`); inputs that
        are not a step's (int64 ids and positions on the CPU) run the model eagerly."""
        fn.disable_guard_check()
        model, long = self.model, torch.long

        def run(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            if input_ids.dtype is long and positions.dtype is long and not input_ids.is_cuda:
                return fn(input_ids, positions)
            return model(input_ids, positions)

        return run
