"""Stage 10's shapes: OpenAI response objects, stream chunks, usage and logprobs."""
from __future__ import annotations

import codecs
import json
from typing import Any

from lifeline.engine.executor import TokenLogprobs


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          reasoning_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


def sse(obj: dict[str, Any] | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                       separators=(",", ":"))
    return f"data: {data}\n\n"


class TokenText:
    """Token ids as the strings and bytes logprobs show."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def bytes(self, token_id: int) -> bytes:
        try:
            return self.tokenizer.token_to_bytes(token_id)
        except Exception:  # noqa: BLE001 - an id the vocabulary cannot show
            return b""

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def pieces(self, ids: list[int], skip_special_tokens: bool) -> list[str]:
        """Each token's share of the text `ids` decode to, in order, so that joined they are
        that text and each starts where the one before ends: a skipped special token is "",
        a token that ends inside a character is "" and the character belongs to the token that
        completes it. What the tokenizer's own decode drops at the start (a leading BOS, the
        space of `add_space_prefix`) is dropped from the first pieces."""
        skip = self.tokenizer.special_token_ids if skip_special_tokens else frozenset()
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pieces = [decoder.decode(b"" if t in skip else self.bytes(t)) for t in ids]
        if pieces:
            pieces[-1] += decoder.decode(b"", final=True)
        joined = "".join(pieces)
        decoded = self.tokenizer.decode(ids, skip_special_tokens)
        cut = len(joined) - len(decoded)
        if cut > 0 and joined.endswith(decoded):
            for i, piece in enumerate(pieces):
                if cut <= 0:
                    break
                pieces[i], cut = piece[cut:], cut - min(cut, len(piece))
        return pieces

    def chat_logprobs(self, items: list[TokenLogprobs]) -> dict[str, Any]:
        return {"content": [self._chat_entry(lp) for lp in items]}

    def _chat_entry(self, lp: TokenLogprobs) -> dict[str, Any]:
        entry = self._token(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [self._token(t, v) for t, v in lp.top]
        return entry

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self.bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": _finite(logprob),
                "bytes": list(raw)}

    def completion_logprobs(self, items: list[TokenLogprobs], offset: int,
                            unscored: int | None = None,
                            texts: list[str] | None = None) -> dict[str, Any]:
        """The legacy shape: each token's top N plus the token itself when it is not among
        them (N + 1 entries at most, as OpenAI's). `unscored`: a token ahead of `items` that
        has no logprob (the first token of an echoed prompt): null in both lists. `texts`:
        the tokens' strings (`pieces`), else each token decoded alone."""
        ids = ([] if unscored is None else [unscored]) + [lp.token_id for lp in items]
        tokens = texts if texts is not None else [self.text(t) for t in ids]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        lead: list[Any] = [] if unscored is None else [None]
        own = tokens[len(lead):]
        return {"tokens": tokens,
                "token_logprobs": lead + [_finite(lp.logprob) for lp in items],
                "top_logprobs": lead + [self._top(lp, t) for lp, t in zip(items, own,
                                                                          strict=True)],
                "text_offset": offsets}

    def _top(self, lp: TokenLogprobs, own: str) -> dict[str, float]:
        """The alternatives by their text; the token itself under `own`, its text in the
        answer."""
        top = {own if t == lp.token_id else self.text(t): _finite(v) for t, v in lp.top}
        top.setdefault(own, _finite(lp.logprob))
        return top


def _finite(value: float) -> float:
    return max(float(value), -9999.0)
