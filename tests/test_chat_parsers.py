"""Reasoning and tool-call parsers: one-shot results against independent regex references, and
streamed results equal to one-shot ones however the text is split."""
from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from lifeline.chat import ReasoningParser, ToolCallDelta, ToolCallParser, opens_reasoning

CALL_F = '{"name": "f", "arguments": {"x": 1}}'
CALL_G = '{"name": "get_weather", "parameters": {"city": "Paris é"}}'
FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", CALL_F, CALL_G, "{bad",
             "<", "</", "<th", "ink>", "<tool_", "call>", "a", "b c", " ", "\n", "é", "{", "}"]
texts = st.one_of(st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join),
                  st.text(alphabet="<>/think_calo{}\" \n", max_size=40))


@st.composite
def split_texts(draw):
    text = draw(texts)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    return text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


# --- reasoning ---------------------------------------------------------------------------------

def reasoning_reference(text: str, starts_in_reasoning: bool) -> tuple[str | None, str]:
    if starts_in_reasoning:
        text = "<think>" + text
    match = re.fullmatch(r"(.*?)<think>(.*?)(?:</think>(.*))?", text, re.DOTALL)
    if match is None:
        return None, text
    before, reasoning, after = match.groups()
    return reasoning, before + (after or "")


def stream_reasoning(pieces: list[str], starts_in_reasoning: bool = False) -> tuple[str, str]:
    parser = ReasoningParser(starts_in_reasoning=starts_in_reasoning)
    out = [parser.feed(piece) for piece in pieces] + [parser.flush()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


REASONING_EXAMPLES = [
    "<think>\nLet me add.\n</think>\n\n4",
    "no reasoning at all",
    "Sure <think>hidden</think> shown </think> kept <think> kept",
    "<think>cut off by max_tokens",
    "<thi<think>x</thin</think>y",
    "",
]


def test_reasoning_examples_match_the_reference():
    for text in REASONING_EXAMPLES:
        for starts in (False, True):
            assert ReasoningParser(starts_in_reasoning=starts).parse(text) == \
                reasoning_reference(text, starts)
    assert ReasoningParser().parse("<think>a</think>\n\nb") == ("a", "\n\nb")


def test_reasoning_stream_split_at_every_position_equals_one_shot():
    for text in REASONING_EXAMPLES:
        for starts in (False, True):
            reasoning, content = ReasoningParser(starts_in_reasoning=starts).parse(text)
            for cut in range(len(text) + 1):
                assert stream_reasoning([text[:cut], text[cut:]], starts) == \
                    (reasoning or "", content)
            assert stream_reasoning(list(text), starts) == (reasoning or "", content)


@settings(max_examples=300, deadline=None)
@given(split_texts(), st.booleans())
def test_reasoning_stream_any_split_equals_one_shot_and_reference(sample, starts):
    text, pieces = sample
    reasoning, content = reasoning_reference(text, starts)
    assert ReasoningParser(starts_in_reasoning=starts).parse(text) == (reasoning, content)
    assert stream_reasoning(pieces, starts) == (reasoning or "", content)


def test_a_partial_tag_is_held_back_until_decided():
    parser = ReasoningParser()
    assert parser.feed("Hi <thi") == ("", "Hi ")
    assert parser.feed("nk>plan</th") == ("plan", "")
    assert parser.in_reasoning
    assert parser.feed("ink>answer <") == ("", "answer <")
    assert not parser.in_reasoning
    other = ReasoningParser()
    assert other.feed("<thin") == ("", "")
    assert other.flush() == ("", "<thin")


def test_a_prompt_that_ends_in_think_starts_the_output_in_reasoning():
    prompt = "<|im_start|>assistant\n<think>\n"
    assert opens_reasoning(prompt)
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    parser = ReasoningParser(starts_in_reasoning=opens_reasoning(prompt))
    assert parser.parse("step 1</think>\n\nanswer") == ("step 1", "\n\nanswer")


# --- tool calls --------------------------------------------------------------------------------

def valid_call(body: str) -> tuple[str, dict] | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (data["name"], args) if isinstance(args, dict) else None


def tool_reference(text: str) -> tuple[str, list[tuple[str, dict]]]:
    """Valid blocks leave, with the whitespace around them; everything else is content."""
    pieces: list[str | tuple[str, dict]] = []
    pos = 0
    for match in re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
        call = valid_call(match.group(1))
        if call is not None:
            pieces += [text[pos:match.start()], call]
            pos = match.end()
    pieces.append(text[pos:])
    content = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            if i > 0:
                piece = piece.lstrip()
            if i < len(pieces) - 1:
                piece = piece.rstrip()
            content.append(piece)
    return "".join(content), [p for p in pieces if isinstance(p, tuple)]


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def stream_tools(pieces: list[str]) -> tuple[str, list[ToolCallDelta]]:
    parser = ToolCallParser()
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.flush()
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert [(d.id, d.name, d.arguments) for d in deltas] == \
        [(c.id, c.name, c.arguments) for c in parser.calls]
    assert [d.index for d in deltas] == list(range(len(deltas)))
    return "".join(e for e in events if isinstance(e, str)), deltas


TOOL_EXAMPLES = [
    f"Let me check.\n<tool_call>\n{CALL_F}\n</tool_call>\n<tool_call>\n{CALL_G}\n</tool_call>\n",
    f"<tool_call>{CALL_F}</tool_call>",
    "x <tool_call>{not json}</tool_call> y",
    f"before <tool_call>{CALL_F}</tool_call> between <tool_call>{CALL_G}",
    "plain text, trailing space  ",
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>',
    "<tool_ca",
]


def test_tool_call_examples_match_the_reference():
    for text in TOOL_EXAMPLES:
        content, calls = ToolCallParser().parse(text)
        want_content, want_calls = tool_reference(text)
        assert (content, calls_of(calls)) == (want_content, want_calls)
    content, calls = ToolCallParser().parse(TOOL_EXAMPLES[0])
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [
        ("f", '{"x": 1}'), ("get_weather", '{"city": "Paris é"}')]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id


def test_invalid_or_unclosed_calls_stay_in_the_content():
    assert ToolCallParser().parse("x <tool_call>{not json}</tool_call> y") == \
        ("x <tool_call>{not json}</tool_call> y", [])
    assert ToolCallParser().parse(f"<tool_call>{CALL_F}") == (f"<tool_call>{CALL_F}", [])


def test_tool_stream_split_at_every_position_equals_one_shot():
    for text in TOOL_EXAMPLES:
        content, calls = ToolCallParser().parse(text)
        for cut in range(len(text) + 1):
            got, deltas = stream_tools([text[:cut], text[cut:]])
            assert (got, calls_of(deltas)) == (content, calls_of(calls))
        got, deltas = stream_tools(list(text))
        assert (got, calls_of(deltas)) == (content, calls_of(calls))


@settings(max_examples=300, deadline=None)
@given(split_texts())
def test_tool_stream_any_split_equals_one_shot_and_reference(sample):
    text, pieces = sample
    content, calls = ToolCallParser().parse(text)
    assert (content, calls_of(calls)) == tool_reference(text)
    got, deltas = stream_tools(pieces)
    assert (got, calls_of(deltas)) == (content, calls_of(calls))


def test_tag_text_never_reaches_streamed_content():
    parser = ToolCallParser()
    assert parser.feed("Checking <tool_") == ["Checking"]
    assert parser.feed('call>{"name": "f", ') == []
    events = parser.feed('"arguments": {}}</tool_call> done')
    assert isinstance(events[0], ToolCallDelta) and events[1:] == ["done"]
    assert events[0].as_dict() == {"index": 0, "id": events[0].id, "type": "function",
                                   "function": {"name": "f", "arguments": "{}"}}
    assert parser.flush() == []
