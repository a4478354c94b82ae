"""One step's logits to next tokens: bias, min_tokens, penalties, filtering, seeded sampling."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from lifeline.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingInput:
    """What the sampler needs to know about the request behind one row of logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    """The token that was chosen."""
    logprob: float
    """Its logprob under the raw logits."""
    top: list[tuple[int, float]]
    """The `params.logprobs` most likely (token id, logprob) pairs, most likely first."""


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The private random stream of a seeded request, on the device its logits live on."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Chooses one token per row of a [B, V] logits tensor.

    Order: logit_bias, min_tokens (EOS and stop ids masked), repetition penalty (prompt and
    output ids), presence and frequency penalties (output ids); greedy rows take the argmax, the
    others go through temperature, top-k, top-p, min-p and an exponential race. A seeded row draws
    its noise from its own generator only, so its token does not depend on the rest of the batch.

    Logprobs, like vLLM's default and OpenAI's, come from the log-softmax of the raw logits, before
    any bias, penalty or temperature: they describe the model, not the sampling settings.
    The input tensor is never modified.
    """

    def __init__(self, eos_token_ids: Iterable[int] = ()) -> None:
        self.eos_token_ids = sorted(set(eos_token_ids))

    def __call__(self, logits: torch.Tensor, inputs: Sequence[SamplingInput]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.size(0) == len(inputs)
        if all(x.params.greedy and not needs_processing(x) for x in inputs):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(inputs))
        processed = self._process(logits, inputs)
        random_rows = [i for i, x in enumerate(inputs) if not x.params.greedy]
        if len(random_rows) < len(inputs):
            tokens = processed.argmax(dim=-1)
        else:
            tokens = torch.empty(len(inputs), dtype=torch.long, device=logits.device)
        if random_rows:
            chosen = [inputs[i] for i in random_rows]
            if len(random_rows) < len(inputs):
                index = torch.tensor(random_rows, device=logits.device)
                rows = processed[index]
            else:
                index, rows = slice(None), processed if processed is not logits else logits.clone()
            probs = filter_logits(rows, [x.params for x in chosen]).softmax(dim=-1)
            tokens[index] = draw(probs, [x.generator for x in chosen])
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, gather_logprobs(logits, token_ids, inputs))

    def _process(self, logits: torch.Tensor, inputs: Sequence[SamplingInput]) -> torch.Tensor:
        """Float32 logits after bias, min_tokens and penalties; a private copy unless no row has
        any of them and `logits` is already float32."""
        processed = logits.float()
        if not any(x.params.logit_bias or has_min_tokens(x) or has_penalties(x.params)
                   for x in inputs):
            return processed
        if processed is logits:
            processed = logits.clone()
        apply_logit_bias(processed, inputs)
        apply_min_tokens(processed, inputs, self.eos_token_ids)
        apply_penalties(processed, inputs)
        return processed


def needs_processing(x: SamplingInput) -> bool:
    p = x.params
    return bool(p.logit_bias or p.logprobs is not None or has_penalties(p) or has_min_tokens(x))


def has_min_tokens(x: SamplingInput) -> bool:
    return len(x.output_token_ids) < x.params.min_tokens


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def apply_logit_bias(logits: torch.Tensor, inputs: Sequence[SamplingInput]) -> None:
    """Adds each row's bias in place; ids outside the vocabulary are ignored."""
    vocab = logits.size(1)
    entries = [
        (row, token, bias)
        for row, x in enumerate(inputs)
        for token, bias in x.params.logit_bias.items()
        if 0 <= token < vocab
    ]
    if not entries:
        return
    rows, tokens, biases = zip(*entries)
    index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
    values = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    logits.index_put_(index, values, accumulate=True)


def apply_min_tokens(
    logits: torch.Tensor, inputs: Sequence[SamplingInput], eos_token_ids: Sequence[int]
) -> None:
    """Forbids the ids that would end the request while it has fewer than min_tokens outputs."""
    vocab = logits.size(1)
    entries = [
        (row, token)
        for row, x in enumerate(inputs)
        if has_min_tokens(x)
        for token in stop_ids(x.params, eos_token_ids)
        if 0 <= token < vocab
    ]
    if not entries:
        return
    rows, tokens = zip(*entries)
    index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
    logits.index_put_(index, torch.tensor(-math.inf, device=logits.device))


def stop_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> set[int]:
    eos = set() if params.ignore_eos else set(eos_token_ids)
    return eos | set(params.stop_token_ids)


def apply_penalties(logits: torch.Tensor, inputs: Sequence[SamplingInput]) -> None:
    """Repetition penalty as in HF/vLLM over prompt and output ids (positive logits divided,
    negative multiplied); presence and frequency penalties as in OpenAI over output ids."""
    rows = [i for i, x in enumerate(inputs) if has_penalties(x.params)]
    if not rows:
        return
    device, vocab = logits.device, logits.size(1)
    index = torch.tensor(rows, device=device)
    chosen = [inputs[i] for i in rows]
    output_counts = token_counts([x.output_token_ids for x in chosen], vocab, device)
    in_prompt = token_counts([x.prompt_token_ids for x in chosen], vocab, device) > 0
    in_output = output_counts > 0

    def column(name: str) -> torch.Tensor:
        values = [getattr(x.params, name) for x in chosen]
        return torch.tensor(values, dtype=logits.dtype, device=device).unsqueeze(1)

    sub = logits[index]
    repetition = column("repetition_penalty")
    penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(in_prompt | in_output, penalized, sub)
    sub -= column("frequency_penalty") * output_counts
    sub -= column("presence_penalty") * in_output
    logits[index] = sub


def token_counts(id_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(id_lists), vocab] float32 occurrence counts; padding goes to a dropped extra column."""
    width = max((len(ids) for ids in id_lists), default=0)
    padded = [list(ids) + [vocab] * (width - len(ids)) for ids in id_lists]
    ids = torch.tensor(padded, dtype=torch.long, device=device).clamp_(0, vocab)
    counts = torch.zeros(len(id_lists), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p (vLLM/HF semantics) in place; removed tokens
    become -inf. Rows that do not use a filter pay neither a sort nor a mask for it."""
    device = logits.device
    temperatures = torch.tensor([p.temperature for p in params], device=device)
    logits.div_(temperatures.unsqueeze(1))
    vocab = logits.size(1)
    top_k_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if top_k_rows:
        apply_top_k(logits, top_k_rows, [params[i].top_k for i in top_k_rows])
    top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if top_p_rows:
        apply_top_p(logits, top_p_rows, [params[i].top_p for i in top_p_rows])
    min_p_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if min_p_rows:
        apply_min_p(logits, min_p_rows, [params[i].min_p for i in min_p_rows])
    return logits


def apply_top_k(logits: torch.Tensor, rows: list[int], ks: list[int]) -> None:
    """Keeps the tokens whose logit is at least the k-th largest (ties survive, as in HF)."""
    index = torch.tensor(rows, device=logits.device)
    sub = logits[index]
    top = sub.topk(max(ks), dim=-1).values
    kth = top.gather(1, torch.tensor(ks, device=logits.device).unsqueeze(1) - 1)
    logits[index] = sub.masked_fill_(sub < kth, -math.inf)


def apply_top_p(logits: torch.Tensor, rows: list[int], ps: list[float]) -> None:
    """Keeps the smallest most-likely set whose probability reaches p (at least one token)."""
    index = torch.tensor(rows, device=logits.device)
    sub = logits[index]
    ascending, order = sub.sort(dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    threshold = 1 - torch.tensor(ps, device=logits.device).unsqueeze(1)
    remove = cumulative <= threshold
    remove[:, -1] = False
    logits[index] = sub.scatter_(1, order, ascending.masked_fill_(remove, -math.inf))


def apply_min_p(logits: torch.Tensor, rows: list[int], min_ps: list[float]) -> None:
    """Drops tokens less likely than min_p times the most likely one, compared in log space."""
    index = torch.tensor(rows, device=logits.device)
    sub = logits[index]
    log_min_p = torch.tensor(min_ps, device=logits.device).log().unsqueeze(1)
    threshold = sub.amax(dim=-1, keepdim=True) + log_min_p
    logits[index] = sub.masked_fill_(sub < threshold, -math.inf)


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Exponential race: argmax(p / q), q ~ Exp(1), picks token i with probability p_i.
    Seeded rows get q from their own generator; the rest share the global one."""
    shared = [row for row, g in enumerate(generators) if g is None]
    if len(shared) == len(generators):
        noise = exponential(probs.shape, probs.device, None)
    else:
        noise = torch.empty_like(probs)
        if shared:
            index = torch.tensor(shared, device=probs.device)
            noise[index] = exponential((len(shared), probs.size(1)), probs.device, None)
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row] = exponential((probs.size(1),), probs.device, generator)
    return probs.div_(noise).argmax(dim=-1)


def exponential(
    shape: Sequence[int], device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    """Exp(1) noise as -log(U): several times faster than exponential_() on CPU. U is kept off 0
    so that q stays finite and a token with p > 0 always beats one with p = 0."""
    uniform = torch.rand(shape, device=device, generator=generator)
    return uniform.clamp_min_(torch.finfo(uniform.dtype).tiny).log_().neg_()


def gather_logprobs(
    raw_logits: torch.Tensor, token_ids: list[int], inputs: Sequence[SamplingInput]
) -> list[TokenLogprobs | None]:
    """Chosen-token and top-N logprobs from the log-softmax of the raw logits."""
    rows = [i for i, x in enumerate(inputs) if x.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(inputs)
    if not rows:
        return result
    device = raw_logits.device
    logprobs = raw_logits[torch.tensor(rows, device=device)].float().log_softmax(dim=-1)
    chosen_ids = torch.tensor([token_ids[i] for i in rows], device=device).unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids).squeeze(1).tolist()
    widest = max(inputs[i].params.logprobs for i in rows)
    top = logprobs.topk(widest, dim=-1)
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    for j, row in enumerate(rows):
        n = inputs[row].params.logprobs
        pairs = list(zip(top_ids[j][:n], top_values[j][:n]))
        result[row] = TokenLogprobs(token_ids[row], chosen[j], pairs)
    return result
