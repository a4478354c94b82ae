"""gguf-py's `GGUFReader` reading its bytes through a plain ndarray view of its memory map.

The reader slices its `np.memmap` for every value it parses: about a million slices for a file
whose vocabulary has 262,144 tokens (Gemma 3's), each paying the memmap subclass's own
`__getitem__` and `__array_finalize__`. The same slices of a base-class view of the same map
are the same bytes, parsed by the same code, in about a third of the time (transformers' GGUF
tokenizer and every reference model read through it; docs/performance.md). Lifeline never uses gguf-py's reader (lifeline.model.gguf_reader is its own), so
this changes only the references' cost, never what they read: tests/test_gguf_dequant.py holds
the two readings equal."""
from __future__ import annotations

from typing import Any

import numpy as np
from gguf.gguf_reader import GGUFReader

_original_get = GGUFReader._get


def _get(self: GGUFReader, offset: int, dtype: Any, count: int = 1,
         override_order: Any = None) -> np.ndarray:
    """`GGUFReader._get` over `self.data.view(np.ndarray)` (made once per reader)."""
    plain = self.__dict__.get("_plain_data")
    if plain is None:
        plain = self.__dict__["_plain_data"] = self.data.view(np.ndarray)
    count = int(count)
    itemsize = int(np.empty([], dtype=dtype).itemsize)
    arr = plain[offset:offset + itemsize * count].view(dtype=dtype)[:count]
    return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None
                                           else override_order))


def use_plain_views(on: bool = True) -> None:
    """Make every `GGUFReader` of this process parse through plain views (or, `on=False`, its
    own memmap slices again)."""
    GGUFReader._get = _get if on else _original_get
