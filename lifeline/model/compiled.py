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
"""
from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lifeline.model.native import native_ops
from lifeline.model.registry import family_of


def _onednn_int8_as_is() -> None:
    """Have Inductor call oneDNN's int8 GEMM as it is (a fallback kernel) instead of lowering
    it: its lowering expects the packed weights as constants of a frozen graph
    (`freezing=True`, which our lifted module attributes are not)."""
    from torch._inductor import lowering, mkldnn_lowerings  # noqa: F401 (registers the lowering)

    op = torch.ops.onednn.qlinear_pointwise.default
    lowering.lowerings.pop(op, None)
    lowering.make_fallback(op, warn=False)


if hasattr(torch.ops.onednn, "qlinear_pointwise"):
    _onednn_int8_as_is()

_LIB = torch.library.Library("lifeline", "FRAGMENT")
_LIB.define("int8_linear(Tensor x, int handle) -> Tensor")

_GEMMS: dict[int, tuple[Any, bool, int]] = {}
"""handle -> (fbgemm's packed weights, reduce_range, out_features) of a live int8 layer."""
_linear_dynamic = torch.ops.quantized.linear_dynamic.default
_next_handle = iter(range(1 << 62))


def _int8_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    packed, reduce_range, _ = _GEMMS[handle]  # a dict lookup, no module attribute lookups
    return _linear_dynamic(x, packed, reduce_range)


def _int8_linear_meta(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _GEMMS[handle][2])


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


def compile_forward(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`model(input_ids, positions)` as a compiled function of the same signature, called
    inside the step's forward context. Int8 layers get handles; the first calls of each shape
    class compile (`warmup` runs them)."""
    if not supports_compile(model):
        raise ValueError(f"{type(model).__name__} does not support compile")
    for module in model.modules():
        if hasattr(module, "int8_matmul") and not module.rescore_top:
            module.compile_handle = register_int8_linear(module)
            module.compile_op = int8_linear_op()
    forward = model.forward

    def traced(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return forward(input_ids, positions)

    # Dynamo caches graphs by code object and, with module guards skipped, would hand this
    # model a graph traced through another one: each model gets a code object of its own.
    code = traced.__code__.replace(co_name=f"traced_{next(_next_handle)}")
    traced = types.FunctionType(code, traced.__globals__, code.co_name, None, traced.__closure__)
    compiled = torch.compile(traced, dynamic=None, options={
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})

    def run(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(input_ids, 0)
            torch._dynamo.maybe_mark_dynamic(positions, 0)
        return compiled(input_ids, positions)

    return run
