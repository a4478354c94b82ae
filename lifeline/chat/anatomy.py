"""Prompt anatomy: how many prompt tokens came from the system prompt, the tool definitions,
the history, the latest user message and the template's own scaffolding.

Method. The prompt is rendered twice more: with every message text (content, reasoning, tool
call names) replaced by a unique sentinel, and (when tools are given) also without tools. The
sentinel render splits into scaffolding and sentinels; the real prompt is matched against it
piece by piece, which locates each message's text as the template printed it (trimmed or not).
Scaffolding that is present only because tools were given counts as `tools`; the JSON of an
assistant's tool-call arguments counts as `history`; everything else the template wrote (role
markers, BOS, the generation prompt, default system text) is `template`. A template that
rewrites message text (so the real prompt no longer matches) falls back to searching each text
in order.

Tokens. Each character gets one label; each token takes the label of its first byte (the
tokens' bytes are laid over the prompt's). Where a tokenizer's bytes do not spell the prompt,
the prompt is encoded prefix by prefix at every label boundary and each part gets the
difference. Either way the parts sum exactly to the prompt's token count. A BOS added by the
tokenizer counts as `template`; it is added only when the prompt does not already start with
the BOS text (see `prompt_add_special_tokens`)."""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from difflib import SequenceMatcher
from itertools import accumulate
from typing import Any

from lifeline.chat.errors import ChatError
from lifeline.chat.templates import ChatInputs, ChatTemplate
from lifeline.tokenizer import Tokenizer
from lifeline.tokenizer.specials import unescape

TEMPLATE, SYSTEM, TOOLS, HISTORY, LATEST_USER = range(5)
_SENTINEL = re.compile("\ue000(\\d+)\ue001")


@dataclass(slots=True, frozen=True)
class PromptAnatomy:
    """Prompt tokens by origin; the parts sum to `total`."""

    system: int
    """Text of system (and developer) messages."""
    tools: int
    """What the template writes because tools were given (schemas, instructions)."""
    history: int
    """Text of every message but the system ones and the latest user message."""
    latest_user: int
    """Text of the last user message."""
    template: int
    """Scaffolding: BOS, role markers, separators, the generation prompt."""
    total: int
    """The prompt's token count."""

    def __post_init__(self) -> None:
        parts = self.system + self.tools + self.history + self.latest_user + self.template
        if parts != self.total:
            raise ValueError(f"anatomy parts sum to {parts}, not {self.total}")

    def as_dict(self) -> dict[str, int]:
        return {"system": self.system, "tools": self.tools, "history": self.history,
                "latest_user": self.latest_user, "template": self.template, "total": self.total}


def prompt_add_special_tokens(tokenizer: Tokenizer, prompt: str) -> bool:
    """`add_special_tokens` for encoding a rendered prompt: False when the template already
    wrote the BOS text (Gemma's and Llama's templates do), so BOS is not doubled."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return True
    return not prompt.startswith(tokenizer.token_to_bytes(bos).decode("utf-8", "replace"))


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The ids of a rendered prompt: special tokens only where the template wrote them (the
    tokenizer's `encode_rendered`), BOS as `prompt_add_special_tokens` says."""
    add_special = prompt_add_special_tokens(tokenizer, prompt)
    return _encoder(tokenizer)(prompt, add_special)


def _encoder(tokenizer: Tokenizer) -> Any:
    return getattr(tokenizer, "encode_rendered", tokenizer.encode)


def prompt_anatomy(template: ChatTemplate, tokenizer: Tokenizer, messages: Any, *,
                   tools: Any = None, tool_choice: Any = None,
                   add_generation_prompt: bool = True, continue_final_message: bool = False,
                   chat_template_kwargs: Any = None,
                   prompt_ids: Sequence[int] | None = None) -> PromptAnatomy:
    """The anatomy of the prompt `template.render(messages, ...)` gives with the same
    arguments. `prompt_ids` (that prompt encoded with `prompt_add_special_tokens`) saves an
    encode."""
    inputs = ChatInputs.from_request(
        messages, tools=tools, tool_choice=tool_choice,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
        content_parts=template.reads_parts)
    return anatomy_of_inputs(template, tokenizer, inputs, prompt_ids)


def anatomy_of_inputs(template: ChatTemplate, tokenizer: Tokenizer, inputs: ChatInputs,
                      prompt_ids: Sequence[int] | None = None) -> PromptAnatomy:
    inputs = template.escaped(inputs)
    prompt = template.render_inputs(inputs)
    labels = label_prompt(template, inputs, prompt)
    add_special = prompt_add_special_tokens(tokenizer, prompt)
    counts = _count_tokens(tokenizer, prompt, labels, add_special, prompt_ids)
    return PromptAnatomy(system=counts[SYSTEM], tools=counts[TOOLS], history=counts[HISTORY],
                         latest_user=counts[LATEST_USER], template=counts[TEMPLATE],
                         total=sum(counts))


# --- characters ------------------------------------------------------------------------------

@dataclass(slots=True)
class _Marked:
    inputs: ChatInputs
    texts: list[str]
    owners: list[int]
    arguments: dict[int, str]
    """Sentinel of a tool call's name → its arguments as `tojson` writes them."""


def label_prompt(template: ChatTemplate, inputs: ChatInputs, prompt: str) -> bytearray:
    """One label (TEMPLATE, SYSTEM, TOOLS, HISTORY, LATEST_USER) per character of `prompt`."""
    marked = _mark(inputs)
    sentinel_text = _render(template, marked.inputs)
    labels = bytearray(len(prompt))
    aligned = None if sentinel_text is None else _align(prompt, sentinel_text, marked, labels)
    if aligned is None:
        _search_texts(prompt, marked, labels)
        plain = _render(template, replace(inputs, tools=None, tool_choice=None))
        if inputs.tools and plain is not None:
            start, end = _changed_span(prompt, plain)
            labels[start:end] = labels[start:end].replace(bytes((TEMPLATE,)), bytes((TOOLS,)))
        return labels
    pieces, text_ends = aligned
    bare = _render(template, replace(marked.inputs, tools=None, tool_choice=None))
    if inputs.tools and bare is not None:
        for start, end in _tools_spans(sentinel_text, bare):
            for r_start, s_start, length in pieces:
                lo, hi = max(start, s_start), min(end, s_start + length)
                if lo < hi:
                    _label_span(labels, lo - s_start + r_start, hi - s_start + r_start, TOOLS)
    _label_arguments(prompt, marked, text_ends, labels)
    return labels


def _render(template: ChatTemplate, inputs: ChatInputs) -> str | None:
    """A variant render; a template may refuse it (e.g. it demands tools), which only makes
    the labelling coarser."""
    try:
        return template.render_inputs(inputs)
    except ChatError:
        return None


def _mark(inputs: ChatInputs) -> _Marked:
    last_user = max((i for i, m in enumerate(inputs.messages) if m["role"] == "user"), default=-1)
    texts: list[str] = []
    owners: list[int] = []
    arguments: dict[int, str] = {}

    def sentinel(text: str, owner: int) -> str:
        if not text:
            return text
        texts.append(text)
        owners.append(owner)
        return f"\ue000{len(texts) - 1}\ue001"

    messages = []
    for i, message in enumerate(inputs.messages):
        role = message["role"]
        owner = SYSTEM if role == "system" else LATEST_USER if i == last_user else HISTORY
        message = dict(message)
        for key in ("content", "reasoning_content"):
            if isinstance(message.get(key), list):
                message[key] = [{**part, "text": sentinel(part["text"], owner)}
                                if part.get("type") == "text" else part for part in message[key]]
            elif key in message:
                message[key] = sentinel(message[key], owner)
        calls = []
        for call in message.get("tool_calls", []):
            name = sentinel(call["function"]["name"], owner)
            if name:
                arguments[len(texts) - 1] = json.dumps(call["function"]["arguments"],
                                                       ensure_ascii=False)
            calls.append({**call, "function": {**call["function"], "name": name}})
        if calls:
            message["tool_calls"] = calls
        messages.append(message)
    return _Marked(replace(inputs, messages=messages), texts, owners, arguments)


def _align(prompt: str, sentinel_text: str, marked: _Marked, labels: bytearray
           ) -> tuple[list[tuple[int, int, int]], dict[int, int]] | None:
    """Match `prompt` to the sentinel render and label the texts. Returns the scaffolding
    pieces as (start in prompt, start in sentinel render, length) and where each text ends;
    None where the two do not match."""
    scaffolds, ids = _split(sentinel_text)
    if any(i >= len(marked.texts) for i in ids):
        return None
    pieces = []
    ends: dict[int, int] = {}
    pos = 0
    for j, (s_start, scaffold) in enumerate(scaffolds):
        if not prompt.startswith(scaffold, pos):
            return None
        pieces.append((pos, s_start, len(scaffold)))
        pos += len(scaffold)
        if j == len(ids):
            break
        end = _text_end(prompt, pos, marked.texts[ids[j]], scaffolds[j + 1][1],
                        last=j + 1 == len(ids))
        if end is None:
            return None
        _label_span(labels, pos, end, marked.owners[ids[j]])
        ends[ids[j]] = pos = end
    return (pieces, ends) if pos == len(prompt) else None


def _split(text: str) -> tuple[list[tuple[int, str]], list[int]]:
    scaffolds, ids, pos = [], [], 0
    for match in _SENTINEL.finditer(text):
        scaffolds.append((pos, text[pos:match.start()]))
        ids.append(int(match.group(1)))
        pos = match.end()
    scaffolds.append((pos, text[pos:]))
    return scaffolds, ids


def _text_end(prompt: str, pos: int, text: str, following: str, last: bool) -> int | None:
    """Where a message text printed at `pos` ends, given the scaffolding that follows it."""
    for printed in dict.fromkeys((text, text.strip(), text.lstrip(), text.rstrip())):
        end = pos + len(printed)
        if prompt.startswith(printed, pos) and prompt.startswith(following, end) and (
                not last or end + len(following) == len(prompt)):
            return end
    if last:
        end = len(prompt) - len(following)
        return end if end >= pos and prompt.endswith(following) else None
    end = prompt.find(following, pos) if following else -1
    return end if end >= 0 else None


def _tools_spans(with_tools: str, without: str) -> list[tuple[int, int]]:
    """Spans of `with_tools` absent from `without`. The sentinels both renders share anchor
    the comparison; between two anchors, what is left once the common prefix and suffix go
    is the tools' part."""
    marks, bare = _SENTINEL.finditer(with_tools), _SENTINEL.finditer(without)
    marks, bare = list(marks), list(bare)
    matcher = SequenceMatcher(None, [m.group(1) for m in marks], [m.group(1) for m in bare],
                              autojunk=False)
    anchors = [(marks[block.a + k].span(), bare[block.b + k].span())
               for block in matcher.get_matching_blocks() for k in range(block.size)]
    anchors.append(((len(with_tools),) * 2, (len(without),) * 2))
    spans = []
    pos = bare_pos = 0
    for (start, end), (bare_start, bare_end) in anchors:
        lo, hi = _changed_span(with_tools[pos:start], without[bare_pos:bare_start])
        if lo < hi:
            spans.append((pos + lo, pos + hi))
        pos, bare_pos = end, bare_end
    return spans


def _changed_span(text: str, other: str) -> tuple[int, int]:
    """The middle of `text` left when the prefix and suffix it shares with `other` go."""
    limit = min(len(text), len(other))
    lo = 0
    while lo < limit and text[lo] == other[lo]:
        lo += 1
    hi = 0
    while hi < limit - lo and text[-1 - hi] == other[-1 - hi]:
        hi += 1
    hi = len(text) - hi
    if lo + len(text) - hi == len(other):
        return _shift_insertion(text, lo, hi)
    return lo, hi


def _shift_insertion(text: str, lo: int, hi: int) -> tuple[int, int]:
    """An inserted block can slide along repeated text: a tool-call block inserted between a
    newline and `<|im_end|>` also reads as inserted after the newline and the `<`. Slide it
    left to where it starts a line or a marker, when it can."""
    shift = 0
    while not _starts_piece(text, lo - shift) and lo - shift > 0 and \
            text[lo - shift - 1] == text[hi - shift - 1]:
        shift += 1
    return (lo - shift, hi - shift) if _starts_piece(text, lo - shift) else (lo, hi)


def _starts_piece(text: str, at: int) -> bool:
    return at == 0 or text[at - 1].isspace() or text[at:at + 1] == "<"


def _label_arguments(prompt: str, marked: _Marked, text_ends: dict[int, int],
                     labels: bytearray) -> None:
    """Tool-call arguments are printed by the template (as JSON), not found by sentinel: look
    for them in the scaffolding after their call's name, before the next message text."""
    for sid, arguments in marked.arguments.items():
        after = text_ends.get(sid)
        at = -1 if after is None else prompt.find(arguments, after)
        if at >= 0 and _only_scaffolding(labels[after:at + len(arguments)]):
            _label_span(labels, at, at + len(arguments), marked.owners[sid])


def _only_scaffolding(labels: bytearray) -> bool:
    return not labels.translate(None, bytes((TEMPLATE, TOOLS)))


def _search_texts(prompt: str, marked: _Marked, labels: bytearray) -> None:
    pos = 0
    for text, owner in zip(marked.texts, marked.owners, strict=True):
        for printed in dict.fromkeys((text, text.strip())):
            at = prompt.find(printed, pos) if printed else -1
            if at >= 0:
                _label_span(labels, at, at + len(printed), owner)
                pos = at + len(printed)
                break


def _label_span(labels: bytearray, start: int, end: int, label: int) -> None:
    if start < end:
        labels[start:end] = bytes((label,)) * (end - start)


# --- tokens ----------------------------------------------------------------------------------

def _runs(labels: bytearray) -> list[tuple[int, int, int]]:
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            runs.append((start, i, labels[start]))
            start = i
    return runs


def _count_tokens(tokenizer: Tokenizer, prompt: str, labels: bytearray, add_special: bool,
                  prompt_ids: Sequence[int] | None) -> list[int]:
    """`prompt` may hold placeholders (one character for one), so labels index the text the
    tokens spell as well."""
    ids = list(prompt_ids) if prompt_ids is not None else _encoder(tokenizer)(prompt, add_special)
    counts = [0] * 5
    runs = _runs(labels)
    text = unescape(prompt)
    starts = _byte_starts(tokenizer, ids, text)
    if starts is None:
        return _count_by_prefixes(tokenizer, prompt, runs, add_special)
    byte_labels = bytearray()
    for start, end, label in runs:
        byte_labels += bytes((label,)) * len(text[start:end].encode())
    counts[TEMPLATE] += len(ids) - len(starts)
    for start in starts:
        counts[byte_labels[start] if start < len(byte_labels) else TEMPLATE] += 1
    return counts


def _byte_starts(tokenizer: Tokenizer, ids: list[int], prompt: str) -> list[int] | None:
    """Where each token starts in the prompt's UTF-8 bytes, leaving out a leading BOS the
    tokenizer added. None when the tokens' bytes do not spell the prompt."""
    data = prompt.encode()
    pieces = [tokenizer.token_to_bytes(i) for i in ids]
    skip = 0
    if b"".join(pieces) != data:
        if not ids or ids[0] != tokenizer.bos_token_id or b"".join(pieces[1:]) != data:
            return None
        skip = 1
    return [0, *accumulate(len(p) for p in pieces[skip:])][:-1]


def _count_by_prefixes(tokenizer: Tokenizer, prompt: str, runs: list[tuple[int, int, int]],
                       add_special: bool) -> list[int]:
    counts = [0] * 5
    encode = _encoder(tokenizer)
    before = len(encode("", add_special))
    counts[TEMPLATE] += before
    for _, end, label in runs:
        upto = len(encode(prompt[:end], add_special))
        counts[label] += upto - before
        before = upto
    return counts
