"""The sampler chooses tokens as transformers' processors and the OpenAI formulas say it should."""
from __future__ import annotations

import math
from collections import Counter

import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lifeline.engine.sampler import (
    TOP_P_CANDIDATES,
    Sampler,
    SamplingInput,
    apply_penalties,
    filter_logits,
    make_generator,
)
from lifeline.engine.sampling_params import SamplingParams

EOS = 3


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def row(prompt: list[int] | None = None, output: list[int] | None = None, **kw) -> SamplingInput:
    params = SamplingParams(**kw)
    return SamplingInput(params, prompt or [], output or [], make_generator(params.seed))


def hf_filtered(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p through transformers' warpers, in its own order."""
    scores = TemperatureLogitsWarper(p.temperature)(None, logits.clone().unsqueeze(0))
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(None, scores)
    return scores.squeeze(0)


FILTERS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.3, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 0.5, "top_k": 20, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 2.0, "top_k": 1},
    {"temperature": 1.0, "top_p": 0.3, "min_p": 0.2},
]


def test_greedy_rows_take_the_argmax():
    logits = random_logits(6, 1000)
    out = Sampler([EOS])(logits, [row(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits = random_logits(4, 500)
    inputs = [row(temperature=0.0), row(temperature=1.0), row(temperature=0.0, logprobs=2),
              row(temperature=0.9, top_p=0.5)]
    out = Sampler([EOS])(logits, inputs)
    assert [out.token_ids[i] for i in (0, 2)] == [logits[i].argmax().item() for i in (0, 2)]


def test_input_logits_are_not_modified():
    logits = random_logits(3, 100)
    before = logits.clone()
    inputs = [row(temperature=0.5, top_k=3, repetition_penalty=1.5, output=[1, 2], logprobs=1,
                  logit_bias={4: 5.0}, min_tokens=5) for _ in range(3)]
    Sampler([EOS])(logits, inputs)
    assert torch.equal(logits, before)


def test_filters_match_transformers_warpers_row_by_row():
    logits = random_logits(len(FILTERS), 300, seed=1)
    params = [SamplingParams(**f) for f in FILTERS]
    ours = filter_logits(logits.clone(), params)
    for i, p in enumerate(params):
        theirs = hf_filtered(logits[i], p)
        assert torch.equal(ours[i].isfinite(), theirs.isfinite()), FILTERS[i]
        torch.testing.assert_close(ours[i].softmax(-1), theirs.softmax(-1), atol=1e-6, rtol=1e-5)


def test_top_p_on_a_wide_vocabulary_matches_transformers_when_the_cut_is_deep_or_shallow():
    vocab = 4096
    peaked = random_logits(2, vocab, seed=9, scale=4.0)
    logits = torch.cat([peaked, random_logits(2, vocab, seed=10, scale=0.2)])
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.8, temperature=1.5),
              SamplingParams(top_p=0.95), SamplingParams(top_p=0.6, top_k=2000)]
    ours = filter_logits(logits.clone(), params)
    for i, p in enumerate(params):
        theirs = hf_filtered(logits[i], p)
        assert torch.equal(ours[i].isfinite(), theirs.isfinite()), i
        torch.testing.assert_close(ours[i].softmax(-1), theirs.softmax(-1), atol=1e-6, rtol=1e-5)
    kept = ours.isfinite().sum(-1)
    assert kept[0] < TOP_P_CANDIDATES < kept[2]


def test_sampled_tokens_stay_in_the_allowed_set_and_follow_the_filtered_softmax():
    draws, vocab = 10_000, 12
    base = random_logits(1, vocab, seed=2, scale=1.5)[0]
    torch.manual_seed(0)
    for f in FILTERS:
        expected = hf_filtered(base, SamplingParams(**f)).softmax(-1)
        out = Sampler([EOS])(base.expand(draws, vocab), [row(**f) for _ in range(draws)])
        counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double()
        assert (counts[expected == 0] == 0).all(), f
        assert chi_square(counts, expected.double() * draws) < chi_square_bound(expected), f


def test_seeded_rows_follow_the_filtered_softmax():
    draws, vocab = 4_000, 8
    base = random_logits(1, vocab, seed=3, scale=1.0)[0]
    params = {"temperature": 0.8, "top_p": 0.9}
    expected = hf_filtered(base, SamplingParams(**params)).softmax(-1)
    inputs = [row(seed=s, **params) for s in range(draws)]
    out = Sampler([EOS])(base.expand(draws, vocab), inputs)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double()
    assert (counts[expected == 0] == 0).all()
    assert chi_square(counts, expected.double() * draws) < chi_square_bound(expected)


def chi_square(observed: torch.Tensor, expected: torch.Tensor) -> float:
    allowed = expected > 0
    return float(((observed[allowed] - expected[allowed]) ** 2 / expected[allowed]).sum())


def chi_square_bound(expected: torch.Tensor) -> float:
    """Mean plus six standard deviations of a chi-square with k - 1 degrees of freedom."""
    dof = max(int((expected > 0).sum()) - 1, 1)
    return dof + 6 * math.sqrt(2 * dof)


def test_repetition_penalty_matches_transformers():
    vocab = 50
    logits = random_logits(3, vocab, seed=4)
    inputs = [row([1, 2, 2, 7], [9, 1], repetition_penalty=1.3),
              row([], [5, 5, 40], repetition_penalty=0.7),
              row([0, 49], [], repetition_penalty=2.0)]
    ours = logits.clone()
    apply_penalties(ours, inputs)
    for i, x in enumerate(inputs):
        ids = torch.tensor([list(x.prompt_token_ids) + list(x.output_token_ids)])
        theirs = RepetitionPenaltyLogitsProcessor(x.params.repetition_penalty)(
            ids, logits[i : i + 1].clone()
        )
        torch.testing.assert_close(ours[i], theirs[0])


def test_presence_and_frequency_penalties_follow_the_openai_formula_over_output_only():
    vocab = 40
    logits = random_logits(2, vocab, seed=5)
    inputs = [row([6, 6, 7], [1, 1, 1, 2, 30], presence_penalty=0.5, frequency_penalty=0.3),
              row([1], [3, 4, 3], presence_penalty=-1.0, frequency_penalty=1.5)]
    ours = logits.clone()
    apply_penalties(ours, inputs)
    for i, x in enumerate(inputs):
        expected = logits[i].clone()
        for token, count in Counter(x.output_token_ids).items():
            p = x.params
            expected[token] -= count * p.frequency_penalty + p.presence_penalty
        torch.testing.assert_close(ours[i], expected)


def test_repetition_penalty_comes_before_presence_and_frequency():
    logits = random_logits(1, 20, seed=6)
    x = row([2, 8], [8, 8, 11], repetition_penalty=1.2, presence_penalty=0.4,
            frequency_penalty=0.2)
    ours = logits.clone()
    apply_penalties(ours, [x])
    ids = torch.tensor([[2, 8, 8, 8, 11]])
    expected = RepetitionPenaltyLogitsProcessor(1.2)(ids, logits.clone())[0]
    expected[8] -= 2 * 0.2 + 0.4
    expected[11] -= 0.2 + 0.4
    torch.testing.assert_close(ours[0], expected)


def test_penalties_change_the_greedy_choice():
    logits = torch.zeros(1, 10)
    logits[0, 4], logits[0, 6] = 2.0, 1.9
    out = Sampler([EOS])(logits, [row([], [4], temperature=0.0, repetition_penalty=1.5)])
    assert out.token_ids == [6]


def test_seeded_rows_ignore_the_rest_of_the_batch():
    vocab, steps = 64, 12
    target = {"seed": 1234, "temperature": 0.9, "top_p": 0.95, "top_k": 30}
    others = [{"temperature": 1.0}, {"temperature": 0.0, "repetition_penalty": 1.2},
              {"seed": 7, "min_p": 0.05, "logprobs": 3}, {"top_k": 3, "frequency_penalty": 0.5}]
    layouts = [(0, []), (0, others), (2, others), (4, others), (1, others[:2]), (3, others[::-1])]
    runs = [run_seeded(target, position, batch, vocab, steps) for position, batch in layouts]
    assert all(r == runs[0] for r in runs)
    assert len(set(runs[0])) > 1


def run_seeded(target: dict, position: int, others: list[dict], vocab: int, steps: int) -> list:
    """The target row's tokens over `steps` steps, its logits the same whatever the batch."""
    inputs = [row([1, 2, 3], **o) for o in others]
    inputs.insert(position, row([1, 2, 3], **target))
    sampler, tokens = Sampler([EOS]), []
    for step in range(steps):
        logits = random_logits(len(inputs), vocab, seed=100 + step, scale=1.0)
        logits[position] = random_logits(1, vocab, seed=step, scale=1.0)[0]
        out = sampler(logits, inputs)
        for x, token in zip(inputs, out.token_ids, strict=True):
            x.output_token_ids.append(token)
        tokens.append(out.token_ids[position])
    return tokens


def test_different_seeds_give_different_draws():
    logits = torch.zeros(1, 1000)
    first = [Sampler()(logits, [row(seed=s)]).token_ids[0] for s in range(5)]
    again = [Sampler()(logits, [row(seed=s)]).token_ids[0] for s in range(5)]
    assert first == again and len(set(first)) > 1


def test_unseeded_rows_need_no_generator():
    assert make_generator(None) is None
    out = Sampler()(torch.zeros(2, 10), [row(), row(top_p=0.5)])
    assert all(0 <= t < 10 for t in out.token_ids)


def test_logprobs_come_from_the_raw_logits_with_sorted_top_n():
    logits = random_logits(3, 200, seed=7)
    inputs = [row([5], [5, 6], temperature=0.3, repetition_penalty=1.4, logprobs=5),
              row(temperature=0.0, logprobs=0, logit_bias={9: 4.0}),
              row(logprobs=None)]
    out = Sampler([EOS])(logits, inputs)
    expected = torch.log_softmax(logits, dim=-1)
    for i in (0, 1):
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert math.isclose(lp.logprob, expected[i, lp.token_id].item(), abs_tol=1e-5)
        n = inputs[i].params.logprobs
        values, ids = expected[i].topk(n) if n else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), values)
    assert out.logprobs[2] is None


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, 10)
    logits[0, EOS], logits[0, 7], logits[0, 1] = 5.0, 4.0, 3.0
    early = row([], [0], temperature=0.0, min_tokens=2, stop_token_ids=[7])
    late = row([], [0, 0], temperature=0.0, min_tokens=2, stop_token_ids=[7])
    assert Sampler([EOS])(logits, [early]).token_ids == [1]
    assert Sampler([EOS])(logits, [late]).token_ids == [EOS]


def test_min_tokens_leaves_eos_alone_when_eos_is_ignored():
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 5.0
    x = row([], [], temperature=0.0, min_tokens=4, ignore_eos=True)
    assert Sampler([EOS])(logits, [x]).token_ids == [EOS]


def test_sampled_rows_never_emit_masked_eos():
    logits = torch.zeros(500, 6)
    logits[:, EOS] = 3.0
    out = Sampler([EOS])(logits, [row([], [], min_tokens=1) for _ in range(500)])
    assert EOS not in out.token_ids


def test_logit_bias_shifts_and_bans_tokens():
    logits = random_logits(2, 30, seed=8)
    inputs = [row(temperature=0.0, logit_bias={17: 100.0}),
              row(temperature=0.0, logit_bias={int(logits[1].argmax()): -100.0, 99: 5.0})]
    out = Sampler()(logits, inputs)
    assert out.token_ids[0] == 17
    assert out.token_ids[1] == int(logits[1].topk(2).indices[1])


def test_bfloat16_logits_are_sampled_in_float32():
    logits = random_logits(3, 64, seed=11).to(torch.bfloat16)
    inputs = [row(temperature=0.0), row(temperature=0.0, presence_penalty=0.1, output=[0]),
              row(top_k=2, logprobs=1)]
    out = Sampler([EOS])(logits, inputs)
    assert out.token_ids[0] == int(logits[0].float().argmax())
    assert out.token_ids[2] in logits[2].float().topk(2).indices.tolist()


# --- per-request plans: built once, bit-identical to rebuilding every step --------------------

def rebuilt_bias_and_min_tokens(logits: torch.Tensor, inputs: list[SamplingInput],
                                eos: list[int]) -> torch.Tensor:
    """The former per-step code: one index_put_ over (row, id) lists rebuilt from the params."""
    out, vocab = logits.clone(), logits.size(1)
    entries = [(r, t, b) for r, x in enumerate(inputs) for t, b in x.params.logit_bias.items()
               if 0 <= t < vocab]
    if entries:
        rows, tokens, biases = zip(*entries, strict=True)
        out.index_put_((torch.tensor(rows), torch.tensor(tokens)),
                       torch.tensor(biases, dtype=out.dtype), accumulate=True)
    banned = [(r, t) for r, x in enumerate(inputs) if len(x.output_token_ids) < x.params.min_tokens
              for t in ({*eos} if not x.params.ignore_eos else set()) | {*x.params.stop_token_ids}
              if 0 <= t < vocab]
    if banned:
        rows, tokens = zip(*banned, strict=True)
        out.index_put_((torch.tensor(rows), torch.tensor(tokens)), torch.tensor(-math.inf))
    return out


def planned_rows(seed: int, vocab: int) -> list[SamplingInput]:
    rng = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(6):
        n = int(torch.randint(0, 50, (), generator=rng))
        ids = torch.randint(-5, vocab + 5, (n,), generator=rng).tolist()
        bias = {t: float(b) for t, b in zip(ids, torch.randn(n, generator=rng) * 30)}
        rows.append(row(list(range(i, 3 * i)), [1, 2, 2, 7][: i % 5], logit_bias=bias,
                        min_tokens=3 * (i % 2), stop_token_ids=[5, vocab + 2, 9][: i % 4],
                        ignore_eos=i == 4, repetition_penalty=1.0 + 0.1 * i,
                        frequency_penalty=0.3 * (i % 3), presence_penalty=-0.2 * (i % 2),
                        temperature=0.8 * (i % 3), seed=100 + i))
    return rows


def test_planned_bias_and_min_tokens_equal_rebuilding_them_every_step():
    from lifeline.engine.sampler import apply_logit_bias, apply_min_tokens

    for seed in range(20):
        logits, inputs = random_logits(6, 64, seed), planned_rows(seed, 64)
        ours = logits.clone()
        for _ in range(2):  # the second pass reuses the plan's tensors
            ours = logits.clone()
            apply_logit_bias(ours, inputs)
            apply_min_tokens(ours, inputs, [EOS])
        assert torch.equal(ours, rebuilt_bias_and_min_tokens(logits, inputs, [EOS])), seed


def test_planned_sampling_gives_the_same_tokens_with_bias_min_tokens_and_penalties():
    """Whole steps through the Sampler: a fresh plan every step (the old behaviour: everything
    rebuilt) and one plan kept across steps choose the same tokens and logprobs."""
    sampler = Sampler([EOS])
    kept = planned_rows(7, 64)
    fresh_outputs = [list(x.output_token_ids) for x in kept]
    for step in range(12):
        logits = random_logits(6, 64, 1000 + step)
        fresh = [SamplingInput(x.params, x.prompt_token_ids, out, make_generator(step + i))
                 for i, (x, out) in enumerate(zip(kept, fresh_outputs))]
        for i, x in enumerate(kept):
            x.generator = make_generator(step + i)
        a, b = sampler(logits, kept), sampler(logits, fresh)
        assert a.token_ids == b.token_ids, step
        for x, out, token in zip(kept, fresh_outputs, a.token_ids):
            x.output_token_ids.append(token)
            out.append(token)
    assert all(x.plan.builds <= 2 for x in kept)


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten operators run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class ReadCountingDict(dict):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.reads = 0

    def items(self):
        self.reads += 1
        return super().items()


class ReadCountingList(list):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.reads = 0

    def __iter__(self):
        self.reads += 1
        return super().__iter__()


def run_steps(entries: int, steps: int = 8) -> tuple[list[int], list[tuple[int, int]], int]:
    """Operators per step of a request with `entries` bias ids and as many stop ids, under
    min_tokens all along; how often its bias and stop ids had been read after each step; how
    many tensors its plan built."""
    bias = ReadCountingDict({t: 0.5 for t in range(entries)})
    stop = ReadCountingList(range(entries))
    x = row([1, 2], [], logit_bias=bias, stop_token_ids=stop, min_tokens=100, temperature=0)
    sampler, ops, reads = Sampler([EOS]), [], []
    for step in range(steps):
        counter = OpCounter()
        with counter:
            token = sampler(random_logits(1, 20_000, step), [x]).token_ids[0]
        x.output_token_ids.append(token)
        ops.append(counter.ops)
        reads.append((bias.reads, stop.reads))
    return ops, reads, x.plan.builds


def test_per_step_work_does_not_grow_with_bias_entries_or_stop_ids():
    """The bias and stop ids are read for the first step, when the plan is built, never again;
    after it every step runs the same operators, for 3 entries or 5,000."""
    few_ops, few_reads, few_builds = run_steps(3)
    many_ops, many_reads, many_builds = run_steps(5_000)
    assert few_builds == many_builds == 2
    assert len(set(few_reads)) == len(set(many_reads)) == 1
    assert len(set(few_ops[1:])) == 1 and few_ops[1:] == many_ops[1:]
