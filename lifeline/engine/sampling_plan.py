"""A request's sampling parameters worked out once for all its steps. Importing this does not
import torch (the scheduler's side of the engine stays free of it); the tensors are built on
first use, by the sampler."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lifeline.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(slots=True, eq=False)
class SamplingPlan:
    """What a request's parameters mean for every step, worked out once: the logit_bias ids and
    values and the ids min_tokens forbids as tensors (built on first use, per vocabulary size and
    device), the stop ids as a set. A step then costs one tensor op per row whatever the number
    of entries. `builds` counts the tensors built."""

    params: SamplingParams
    stop_token_ids: frozenset[int] = field(init=False)
    builds: int = field(init=False, default=0)
    _bias: tuple[tuple, torch.Tensor, torch.Tensor] | None = field(init=False, default=None)
    _forbidden: tuple[tuple, torch.Tensor] | None = field(init=False, default=None)
    _generator: torch.Generator | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.stop_token_ids = frozenset(self.params.stop_token_ids)

    def generator(self) -> torch.Generator | None:
        """The private random stream of a seeded request (None unseeded), made on first use
        and kept for the request's life, preemptions included."""
        if self.params.seed is not None and self._generator is None:
            from lifeline.engine.sampler import make_generator

            self._generator = make_generator(self.params.seed)
        return self._generator

    def bias(self, vocab: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, values in `like`'s dtype) of the logit_bias entries inside the vocabulary."""
        key = (vocab, like.device, like.dtype)
        if self._bias is None or self._bias[0] != key:
            import torch

            entries = [(t, b) for t, b in self.params.logit_bias.items() if 0 <= t < vocab]
            ids = torch.tensor([t for t, _ in entries], dtype=torch.int64, device=like.device)
            values = torch.tensor([b for _, b in entries], dtype=like.dtype, device=like.device)
            self._bias, self.builds = (key, ids, values), self.builds + 1
        return self._bias[1], self._bias[2]

    def forbidden(self, eos_token_ids: Sequence[int], vocab: int,
                  device: torch.device) -> torch.Tensor:
        """The ids that would end the request, while min_tokens says it may not end yet."""
        key = (vocab, device, tuple(eos_token_ids))
        if self._forbidden is None or self._forbidden[0] != key:
            import torch

            ids = sorted(t for t in stop_ids(self.params, eos_token_ids) if 0 <= t < vocab)
            tensor = torch.tensor(ids, dtype=torch.int64, device=device)
            self._forbidden, self.builds = (key, tensor), self.builds + 1
        return self._forbidden[1]


def stop_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> set[int]:
    eos = set() if params.ignore_eos else set(eos_token_ids)
    return eos | set(params.stop_token_ids)
