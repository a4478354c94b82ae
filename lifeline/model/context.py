"""The forward context: what one step's forward pass reads besides its tokens and positions
(slots, block tables, prefill chunks and the KV pools), set around each call of the model.

The caller (`ModelRunner`) sets it, calls `model(input_ids, positions)`, and resets it; every
attention layer reads it (`PagedAttention`), in eager mode directly and in compiled mode from
inside its operator, so model code never passes the cache or the metadata through a signature.
One per thread: engines on different threads step independently.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lifeline.model.layers.attention import AttentionMetadata


@dataclass(frozen=True, slots=True)
class ForwardContext:
    meta: AttentionMetadata
    """Slots, prefill chunks and decode contexts of the step's tokens, on the model's device."""
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    """Each layer's K and V pool."""


_local = threading.local()


def set_context(meta: AttentionMetadata,
                kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    _local.context = ForwardContext(meta, kv_caches)


def get_context() -> ForwardContext:
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError("no forward context: call the model inside forward_context(...)")
    return context


def reset_context() -> None:
    _local.context = None


@contextmanager
def forward_context(meta: AttentionMetadata,
                    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
                    ) -> Iterator[ForwardContext]:
    """The step's context for the calls inside the block."""
    set_context(meta, kv_caches)
    try:
        yield _local.context
    finally:
        reset_context()
