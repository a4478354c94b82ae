"""One step's logits to next tokens: bias, min_tokens, penalties, filtering, seeded sampling."""
from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from lifeline.engine.executor import TokenLogprobs
from lifeline.engine.sampling_params import SamplingParams
from lifeline.engine.sampling_plan import SamplingPlan

__all__ = ["Sampler", "SamplerOutput", "SamplingInput", "make_generator"]

TOP_P_CANDIDATES = 1024


@dataclass(slots=True)
class SamplingInput:
    """What the sampler needs to know about the request behind one row of logits. `plan` is
    the request's own, kept across steps (`Request.sampling_plan`); without one a fresh one is
    made, which works the same but rebuilds its tensors."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None
    plan: SamplingPlan | None = None

    def __post_init__(self) -> None:
        if self.plan is None:
            self.plan = SamplingPlan(self.params)


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    from_shortlist: bool = False
    """Greedy took every token from the `argmax` it was handed (the LM head's proof)."""


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

    def __call__(self, logits: torch.Tensor, inputs: Sequence[SamplingInput],
                 argmax: torch.Tensor | None = None) -> SamplerOutput:
        """`argmax`: each row's argmax where already known, else -1 (from the LM head's
        shortlist, `lifeline.model.weight_format.shortlist_argmax`)."""
        assert logits.dim() == 2 and logits.size(0) == len(inputs)
        if all(x.params.greedy and not needs_processing(x) for x in inputs):
            if argmax is not None:
                known = argmax.tolist()
                if known and min(known) >= 0:
                    return SamplerOutput(known, [None] * len(inputs), from_shortlist=True)
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(inputs))
        processed = self._process(logits, inputs)
        random_rows = [i for i, x in enumerate(inputs) if not x.params.greedy]
        if len(random_rows) == len(inputs):
            tokens = sample(processed, inputs)
        else:
            tokens = processed.argmax(dim=-1)
            if random_rows:
                index = torch.tensor(random_rows, device=logits.device)
                tokens[index] = sample(processed[index], [inputs[i] for i in random_rows])
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
    for row, x in enumerate(inputs):
        if x.params.logit_bias:
            ids, values = x.plan.bias(vocab, logits)
            logits[row].index_add_(0, ids, values)


def apply_min_tokens(
    logits: torch.Tensor, inputs: Sequence[SamplingInput], eos_token_ids: Sequence[int]
) -> None:
    """Forbids the ids that would end the request while it has fewer than min_tokens outputs."""
    vocab = logits.size(1)
    for row, x in enumerate(inputs):
        if has_min_tokens(x):
            logits[row].index_fill_(0, x.plan.forbidden(eos_token_ids, vocab, logits.device),
                                    -math.inf)


def apply_penalties(logits: torch.Tensor, inputs: Sequence[SamplingInput]) -> None:
    """Repetition penalty as in HF/vLLM over prompt and output ids (positive logits divided,
    negative multiplied), then presence and frequency penalties as in OpenAI over output ids.
    Only the logits of seen ids are touched, so the cost follows sequence length, not vocab;
    a repeated id reads and writes the same value again, so no deduplication is needed."""
    repeated = [i for i, x in enumerate(inputs) if x.params.repetition_penalty != 1.0]
    seen = [(inputs[i].prompt_token_ids, inputs[i].output_token_ids) for i in repeated]
    index = flat_index(repeated, seen, logits.device)
    if index is not None:
        penalty = per_row(inputs, "repetition_penalty", logits)[index[0]]
        values = logits[index]
        logits[index] = torch.where(values > 0, values / penalty, values * penalty)
    counted = [
        i for i, x in enumerate(inputs) if x.params.presence_penalty or x.params.frequency_penalty
    ]
    index = flat_index(counted, [(inputs[i].output_token_ids,) for i in counted], logits.device)
    if index is not None:
        frequency = per_row(inputs, "frequency_penalty", logits)[index[0]]
        logits.index_put_(index, frequency.neg_(), accumulate=True)
        logits[index] = logits[index] - per_row(inputs, "presence_penalty", logits)[index[0]]


def flat_index(
    rows: Sequence[int], parts: Sequence[tuple[Sequence[int], ...]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, id) index tensors over every id in every row's parts; None when there are none."""
    ids, lengths = array("q"), []
    for row_parts in parts:
        lengths.append(sum(len(part) for part in row_parts))
        for part in row_parts:
            if isinstance(part, list):
                ids.fromlist(part)
            else:
                ids.extend(part)
    if not ids:
        return None
    row_index = torch.tensor(rows).repeat_interleave(torch.tensor(lengths))
    return row_index.to(device), torch.frombuffer(ids, dtype=torch.int64).to(device)


def per_row(inputs: Sequence[SamplingInput], name: str, like: torch.Tensor) -> torch.Tensor:
    values = [getattr(x.params, name) for x in inputs]
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p (vLLM/HF semantics) into a new tensor; removed
    tokens become -inf. Rows that do not use a filter pay neither a sort nor a mask for it."""
    temperatures = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temperatures.unsqueeze(1)
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
    sub, index = select_rows(logits, rows)
    top = sub.topk(max(ks), dim=-1).values
    kth = top.gather(1, torch.tensor(ks, device=logits.device).unsqueeze(1) - 1)
    put_rows(logits, index, sub.masked_fill_(sub < kth, -math.inf))


def apply_top_p(logits: torch.Tensor, rows: list[int], ps: list[float]) -> None:
    """Keeps the most likely tokens until their mass reaches p (at least one; HF semantics).
    The cut is looked for among the top TOP_P_CANDIDATES logits, and only rows whose cut lies
    further down pay for sorting the whole vocabulary."""
    sub, index = select_rows(logits, rows)
    p = torch.tensor(ps, device=logits.device).unsqueeze(1)
    log_total = sub.logsumexp(dim=-1, keepdim=True)
    candidates = sub.topk(min(TOP_P_CANDIDATES, sub.size(1)), dim=-1).values
    threshold, covered = top_p_cut(candidates, log_total, p)
    if candidates.size(1) < sub.size(1) and not bool(covered.all()):
        rest = (~covered).nonzero().squeeze(1)
        descending = sub[rest].sort(dim=-1, descending=True).values
        threshold[rest] = top_p_cut(descending, log_total[rest], p[rest])[0]
    put_rows(logits, index, sub.masked_fill_(sub < threshold, -math.inf))


def top_p_cut(
    descending: torch.Tensor, log_total: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest surviving logit per row, and whether these leading logits held the cut:
    a token survives while the mass of the tokens ahead of it is below p."""
    probs = (descending - log_total).exp()
    cumulative = probs.cumsum(dim=-1)
    kept = ((cumulative - probs) < p).sum(dim=-1, keepdim=True).clamp_min_(1)
    return descending.gather(1, kept - 1), cumulative[:, -1] >= p.squeeze(1)


def apply_min_p(logits: torch.Tensor, rows: list[int], min_ps: list[float]) -> None:
    """Drops tokens less likely than min_p times the most likely one, compared in log space."""
    sub, index = select_rows(logits, rows)
    log_min_p = torch.tensor(min_ps, device=logits.device).log().unsqueeze(1)
    threshold = sub.amax(dim=-1, keepdim=True) + log_min_p
    put_rows(logits, index, sub.masked_fill_(sub < threshold, -math.inf))


def select_rows(logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows to work on: `logits` itself when that is all of them, else a copy and its index."""
    if len(rows) == logits.size(0):
        return logits, None
    index = torch.tensor(rows, device=logits.device)
    return logits[index], index


def put_rows(logits: torch.Tensor, index: torch.Tensor | None, rows: torch.Tensor) -> None:
    if index is None:
        if rows is not logits:
            logits.copy_(rows)
    else:
        logits[index] = rows


def sample(logits: torch.Tensor, inputs: Sequence[SamplingInput]) -> torch.Tensor:
    probs = filter_logits(logits, [x.params for x in inputs]).softmax(dim=-1)
    return draw(probs, [x.generator for x in inputs])


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Exponential race: argmax(p / q), q ~ Exp(1), picks token i with probability p_i. With
    q = -log U this is argmin(p / log U), several times cheaper on CPU than exponential_().
    Seeded rows get U from their own generator (drawn where it lives, then copied, if that is not
    the logits' device); the rest share the global one. U is kept off 0 so that every token with
    p > 0 beats those with p = 0."""
    noise = torch.empty_like(probs)
    shared = [row for row, g in enumerate(generators) if g is None]
    if len(shared) == len(generators):
        noise.uniform_()
    elif shared:
        noise[torch.tensor(shared, device=probs.device)] = torch.rand(
            len(shared), probs.size(1), device=probs.device
        )
    for row, generator in enumerate(generators):
        if generator is None:
            continue
        if generator.device == noise.device:
            noise[row].uniform_(generator=generator)
        else:
            noise[row] = torch.rand(noise.size(1), generator=generator, device=generator.device)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_()
    return probs.div_(noise).argmin(dim=-1)


def gather_logprobs(
    raw_logits: torch.Tensor, token_ids: list[int], inputs: Sequence[SamplingInput]
) -> list[TokenLogprobs | None]:
    """Chosen-token and top-N logprobs from the log-softmax of the raw logits."""
    rows = [i for i, x in enumerate(inputs) if x.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(inputs)
    if not rows:
        return result
    device = raw_logits.device
    logprobs = select_rows(raw_logits, rows)[0].float().log_softmax(dim=-1)
    chosen_ids = torch.tensor([token_ids[i] for i in rows], device=device).unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids).squeeze(1).tolist()
    widest = max(inputs[i].params.logprobs for i in rows)
    top = logprobs.topk(widest, dim=-1)
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    for j, row in enumerate(rows):
        n = inputs[row].params.logprobs
        pairs = list(zip(top_ids[j][:n], top_values[j][:n], strict=True))
        result[row] = TokenLogprobs(token_ids[row], chosen[j], pairs)
    return result
