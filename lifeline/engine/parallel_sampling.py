"""`n` > 1: one request sampled n ways, as n engine requests (the choices) over one prompt. The
server and the offline `LLM` both start a prompt's first choice alone and the others once it
has its first token: by then the prompt's full blocks are in the prefix cache, so the others
compute only what follows the last full block."""
from __future__ import annotations

import dataclasses

from lifeline.engine.sampling_params import SEED_RANGE, SamplingParams

_SEED_SPAN = SEED_RANGE[1] - SEED_RANGE[0] + 1


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of choice `index`: one sample each; a seeded request's choice i draws from
    seed + i (as vLLM's), wrapped into the seed range, so the choices differ yet each is the
    same from run to run."""
    seed = params.seed
    if seed is not None and index:
        seed = (seed + index - SEED_RANGE[0]) % _SEED_SPAN + SEED_RANGE[0]
    if seed == params.seed and params.n == 1:
        return params
    return dataclasses.replace(params, n=1, seed=seed)
