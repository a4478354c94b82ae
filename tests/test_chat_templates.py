"""Chat templates: built-in templates against transformers' renderer, the documented Gemma format,
template sources, request validation, bounded rendering, and prompt anatomy."""
from __future__ import annotations

import json
import time

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from lifeline.chat import (
    BUILTIN_TEMPLATES,
    ChatError,
    ChatTemplate,
    RenderLimits,
    TemplateTimeout,
    builtin_family,
    prompt_add_special_tokens,
    prompt_anatomy,
    resolve_template,
    special_token_texts,
    template_for_request,
)
from lifeline.chat.anatomy import HISTORY, TEMPLATE, TOOLS, label_prompt
from lifeline.chat.templates import ChatInputs

TOOLS_SPEC = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
SYSTEM = "You are a terse assistant."
LATEST = "And tomorrow in London, please?"
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Hi there "},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "Sunny, 18 degrees."},
    {"role": "user", "content": "Thanks! Is it windy?"},
    {"role": "assistant", "content": "A light breeze."},
    {"role": "user", "content": LATEST},
]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
]


def builtin(family: str, **kw) -> ChatTemplate:
    return resolve_template(family=family, bos_token="<bos>", eos_token="<eos>", **kw)


def transformers_render(template: ChatTemplate, messages, **kw) -> str:
    """The same template string rendered by transformers' own Jinja environment."""
    inputs = ChatInputs.from_request(messages, tools=kw.pop("tools", None),
                                     add_generation_prompt=kw.get("add_generation_prompt", True),
                                     continue_final_message=kw.get("continue_final_message",
                                                                   False))
    rendered, _ = render_jinja_template([inputs.messages], tools=inputs.tools,
                                        chat_template=template.source, bos_token="<bos>",
                                        eos_token="<eos>", **kw)
    return rendered[0]


# --- built-in templates against transformers ---------------------------------------------------

CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "Hello"}],
    "system and history": CHAT,
    "no system": CHAT[1:],
    "ends with assistant": CHAT[:3],
    "padded content": [{"role": "user", "content": "  spaced \n"}],
}


@pytest.mark.parametrize("family", sorted(BUILTIN_TEMPLATES))
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_builtin_templates_render_as_transformers_does(family, name, add_generation_prompt):
    template = builtin(family)
    messages = CONVERSATIONS[name]
    ours = template.render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == transformers_render(template, messages,
                                       add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("family", ["llama", "chatml"])
def test_tool_templates_render_as_transformers_does(family):
    template = builtin(family)
    messages = [CHAT[0], *TOOL_TURNS]
    ours = template.render(messages, tools=TOOLS_SPEC)
    assert ours == transformers_render(template, messages, tools=TOOLS_SPEC,
                                       add_generation_prompt=True)
    assert '"get_weather"' in ours and '{"city": "Paris"}' in ours


def test_chatml_tools_use_hermes_blocks():
    prompt = builtin("chatml").render([CHAT[0], *TOOL_TURNS], tools=TOOLS_SPEC)
    assert "<tools>\n" + json.dumps(TOOLS_SPEC[0]) + "\n</tools>" in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n') in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 18}\n</tool_response><|im_end|>' in prompt


@pytest.mark.parametrize("enable_thinking, ending", [
    (None, "<|im_start|>assistant\n"),
    (True, "<|im_start|>assistant\n<think>\n"),
    (False, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
])
def test_chatml_enable_thinking(enable_thinking, ending):
    kwargs = None if enable_thinking is None else {"enable_thinking": enable_thinking}
    prompt = builtin("chatml").render(CHAT, chat_template_kwargs=kwargs)
    assert prompt.endswith("<|im_end|>\n" + ending)


def test_chatml_keeps_reasoning_only_after_the_last_user_message():
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "old thought"},
                {"role": "user", "content": "3+3?"},
                {"role": "assistant", "content": "6", "reasoning_content": "new thought"}]
    prompt = builtin("chatml").render(messages, add_generation_prompt=False)
    assert "old thought" not in prompt
    assert "<|im_start|>assistant\n<think>\nnew thought\n</think>\n\n6<|im_end|>\n" in prompt


# --- the documented Gemma format ---------------------------------------------------------------

def test_gemma_two_turn_chat_matches_the_documented_format():
    # https://ai.google.dev/gemma/docs/core/prompt-structure
    messages = [{"role": "user", "content": "knock knock"},
                {"role": "assistant", "content": "who is there"},
                {"role": "user", "content": "Gemma"},
                {"role": "assistant", "content": "Gemma who?"}]
    assert builtin("gemma3").render(messages, add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nknock knock<end_of_turn>\n"
        "<start_of_turn>model\nwho is there<end_of_turn>\n"
        "<start_of_turn>user\nGemma<end_of_turn>\n"
        "<start_of_turn>model\nGemma who?<end_of_turn>\n")


def test_gemma_folds_the_system_prompt_into_the_first_user_turn():
    prompt = builtin("gemma3").render(CHAT[:2])
    assert prompt == (f"<bos><start_of_turn>user\n{SYSTEM}\n\nHi there<end_of_turn>\n"
                      "<start_of_turn>model\n")


def test_gemma_refuses_turns_that_do_not_alternate():
    with pytest.raises(ChatError) as err:
        builtin("gemma3").render([CHAT[1], CHAT[1]])
    assert err.value.param == "messages" and "alternate" in str(err.value)


GOOGLE_GEMMA3_RULES = (
    "{{ bos_token }}{% if messages[0].role == 'system' %}"
    "{% set head = messages[0].content + '\n\n' %}{% set rest = messages[1:] %}"
    "{% else %}{% set head = '' %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% if (m.role == 'user') != (loop.index0 is even) %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ head if loop.first }}{{ m.content | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
"""The rules of the chat template Google ships with Gemma 3 (`tokenizer_config.json` of the
google/gemma-3-*-it checkpoints), restated for text content: the first system message opens the
first user turn followed by a blank line; every other message must be a user message at even
places and anything but a user message at odd ones, and keeps its role's name (assistant:
model); content is trimmed. So a later system message is accepted where a model turn would be."""


def google_render(messages, add_generation_prompt=True) -> str:
    rendered, _ = render_jinja_template([messages], chat_template=GOOGLE_GEMMA3_RULES,
                                        bos_token="<bos>",
                                        add_generation_prompt=add_generation_prompt)
    return rendered[0]


def _sys(text):
    return {"role": "system", "content": text}


LATER_SYSTEM = {
    "after the first user turn": [_sys("Be brief. "), CHAT[1], _sys(" Now be polite."), CHAT[3]],
    "without a first one": [CHAT[1], _sys("Answer in French."), CHAT[3]],
    "deep in the history": [*CHAT[:4], _sys("Use metric units."), CHAT[5]],
    "last": [*CHAT[1:4], _sys("Stop here.")],
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(LATER_SYSTEM))
def test_gemma_renders_a_later_system_message_as_googles_template_does(name,
                                                                       add_generation_prompt):
    messages = LATER_SYSTEM[name]
    ours = builtin("gemma3").render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == google_render(messages, add_generation_prompt)
    assert "<start_of_turn>system\n" in ours


def test_gemma_puts_a_system_message_in_a_user_place_before_that_user_turn():
    """Where Google's template refuses a system message (where a user turn would be), OpenAI
    takes it: it opens the user turn that follows, as the first system message does."""
    messages = [*CHAT[:3], _sys("Use metric units."), CHAT[3]]
    with pytest.raises(Exception, match="alternate"):
        google_render(messages)
    assert builtin("gemma3").render(messages) == (
        f"<bos><start_of_turn>user\n{SYSTEM}\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nUse metric units.\n\nWhat is the weather in Paris?<end_of_turn>\n"
        "<start_of_turn>model\n")
    alone = builtin("gemma3").render([*CHAT[1:3], _sys("Be brief.")])
    assert alone.endswith("<start_of_turn>model\nHello.<end_of_turn>\n"
                          "<start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n")


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    prompt = builtin("gemma3").render([{"role": "user", "content": parts}])
    assert "<start_of_turn>user\nfirst\nsecond<end_of_turn>" in prompt


def test_continue_final_message_matches_transformers():
    template = builtin("gemma3")
    messages = [*CHAT[1:3], {"role": "user", "content": "Count"},
                {"role": "assistant", "content": "One, two,"}]
    ours = template.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert ours.endswith("<start_of_turn>model\nOne, two,")
    assert ours == transformers_render(template, messages, add_generation_prompt=False,
                                       continue_final_message=True)


# --- where the template comes from -------------------------------------------------------------

def test_template_sources_in_order(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": "HF{{ messages|length }}"}))
    file = tmp_path / "t.jinja"
    file.write_text("FILE")
    assert resolve_template(template_file=file, gguf_template="G", hf_dir=hf,
                            family="gemma3").origin == f"file:{file}"
    assert resolve_template(gguf_template="G", hf_dir=hf, family="gemma3").origin == "gguf"
    from_hf = resolve_template(hf_dir=hf, family="gemma3")
    assert from_hf.origin.startswith("hf:") and from_hf.render(CHAT[1:2]) == "HF1"
    assert resolve_template(hf_dir=tmp_path, family="chatml").origin == "builtin:chatml"
    with pytest.raises(ValueError):
        resolve_template(family="nonesuch")


def test_tokenizer_config_list_form_with_tool_use_variant(tmp_path):
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    template = resolve_template(hf_dir=tmp_path, family="gemma3")
    assert template.render(CHAT[1:2]) == "plain"
    assert template.render(CHAT[1:2], tools=TOOLS_SPEC) == "tools"


def test_default_gguf_has_no_template_so_gemma_builtin_is_used(gguf):
    template = resolve_template(gguf_template=gguf.get("tokenizer.chat_template"),
                                family=builtin_family(gguf.get("general.architecture")))
    assert template.origin == "builtin:gemma3"


def test_request_template_only_when_allowed():
    server = builtin("gemma3")
    assert template_for_request(server, None, allow_request_template=False) is server
    with pytest.raises(ChatError) as err:
        template_for_request(server, "X", allow_request_template=False)
    assert err.value.param == "chat_template"
    own = template_for_request(server, "{{ bos_token }}mine", allow_request_template=True)
    assert own.render(CHAT[1:2]) == "<bos>mine"


# --- validation --------------------------------------------------------------------------------

USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("call, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages"),
    ({"messages": [USER], "continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),
    ({"messages": [USER, {"role": "assistant", "content": "a"}], "continue_final_message": True},
     "continue_final_message"),
    ({"messages": [USER], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [USER], "tools": TOOLS_SPEC,
      "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"messages": [USER], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [USER], "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"messages": [USER], "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
])
def test_invalid_requests_name_their_field(call, param):
    call = dict(call)
    messages = call.pop("messages")
    with pytest.raises(ChatError) as err:
        builtin("chatml").render(messages, **call)
    assert err.value.param == param
    assert str(err.value)


def test_template_errors_name_their_field():
    with pytest.raises(ChatError) as err:
        ChatTemplate("{% for %}", "request")
    assert err.value.param == "chat_template"
    with pytest.raises(ChatError) as err:
        ChatTemplate("{{ raise_exception('no system role') }}", "request").render([USER])
    assert err.value.param == "messages" and "no system role" in str(err.value)
    for escape in ("{{ messages.__class__.__mro__ }}", "{{ messages.append(1) }}"):
        with pytest.raises(ChatError) as err:
            ChatTemplate(escape, "request").render([USER])
        assert err.value.param == "chat_template" and "unsafe" in str(err.value)


# --- bounded rendering -------------------------------------------------------------------------

RUNAWAYS = {
    "billion-step loop": "{% for i in range(10**9) %}x{% endfor %}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}x"
                    "{% endfor %}{% endfor %}",
    "nested loops, no output": "{% for i in range(100000) %}{% for j in range(100000) %}"
                               "{% endfor %}{% endfor %}",
    "loops into a buffer": "{% set s %}{% for i in range(100000) %}{% for j in range(100000) %}"
                           "x{% endfor %}{% endfor %}{% endset %}",
    "string doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                       "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "list doubling": "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}"
                     "{% set ns.l = ns.l + ns.l %}{% endfor %}",
    "huge repeat": "{{ 'x' * 10**12 }}",
    "huge power": "{{ 10 ** (10 ** 10) }}",
    "huge padding": "{{ 'x'.center(10**12) }}{{ 'x'|center(10**12) }}",
    "huge format width": "{{ '%09999999999d' % 1 }}",
    "endless recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
}


@pytest.mark.parametrize("name", sorted(RUNAWAYS))
def test_runaway_templates_are_stopped(name):
    template = ChatTemplate(RUNAWAYS[name], "request")
    began = time.monotonic()
    with pytest.raises(TemplateTimeout) as err:
        template.render([USER])
    assert time.monotonic() - began < 3
    assert err.value.param == "chat_template"


def test_the_deadline_stops_a_loop_the_operation_count_would_allow():
    limits = RenderLimits(timeout_s=0.3, max_operations=10**12, max_output_chars=10**12)
    template = ChatTemplate(RUNAWAYS["nested loops"], "request", limits=limits)
    began = time.monotonic()
    with pytest.raises(TemplateTimeout, match="0.3 s"):
        template.render([USER])
    assert time.monotonic() - began < 1.5


def test_the_deadline_is_checked_between_slow_operations():
    # each operation ~0.1 s (a sort of 200,000 items), 1,000 of them (~100 s): the render stops
    # at the first check past the deadline, far before the loop ends. The bound is a fifth of
    # the loop, not a latency: a loaded machine took 2.8 s where an idle one takes 0.4 s.
    template = ChatTemplate("{% for i in range(1000) %}{{ ((range(20000)|list) * 10)|sort"
                            "|length }}{% endfor %}", "request", limits=RenderLimits(timeout_s=0.3))
    began = time.monotonic()
    with pytest.raises(TemplateTimeout, match="0.3 s"):
        template.render([USER])
    assert time.monotonic() - began < 20


def test_limits_leave_ordinary_templates_alone():
    long_chat = [m for _ in range(200) for m in (CHAT[1], CHAT[2])]
    for family in BUILTIN_TEMPLATES:
        builtin(family).render(long_chat, tools=TOOLS_SPEC if family != "gemma3" else None)


# --- prompt anatomy ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf():
    from lifeline.model.default import default_model_path
    from lifeline.model.gguf_file import GGUFFile

    return GGUFFile(default_model_path())


@pytest.fixture(scope="module")
def tok(gguf):
    from lifeline.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf_reader(gguf.reader)


def encode_prompt(tok, prompt: str) -> list[int]:
    return tok.encode(prompt, add_special_tokens=prompt_add_special_tokens(tok, prompt))


def n_tokens(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def test_gemma_anatomy_sums_to_the_prompt_and_counts_each_text(tok):
    template = builtin("gemma3")
    prompt = template.render(CHAT, tools=TOOLS_SPEC)
    assert prompt.startswith("<bos>") and not prompt_add_special_tokens(tok, prompt)
    ids = encode_prompt(tok, prompt)
    anatomy = prompt_anatomy(template, tok, CHAT, tools=TOOLS_SPEC)
    parts = anatomy.as_dict()
    assert anatomy.total == len(ids) == sum(v for k, v in parts.items() if k != "total")
    # Gemma's template shows no tools to the model; each text sits between special tokens and
    # newlines, so its count is the count of the text tokenized alone.
    assert anatomy.tools == 0
    assert anatomy.system == n_tokens(tok, SYSTEM)
    assert anatomy.latest_user == n_tokens(tok, LATEST)
    assert anatomy.history == sum(n_tokens(tok, m["content"].strip()) for m in CHAT[1:-1])
    assert anatomy.template > 0
    assert prompt_anatomy(template, tok, CHAT, tools=TOOLS_SPEC, prompt_ids=ids) == anatomy


def test_special_token_texts_come_from_the_tokenizer(tok):
    assert special_token_texts(tok) == {"bos_token": "<bos>", "eos_token": "<eos>"}
    template = resolve_template(family="gemma3", **special_token_texts(tok))
    assert template.render(CHAT[1:2]).startswith("<bos><start_of_turn>user\n")


def test_chatml_anatomy_counts_tools_and_the_added_bos(tok):
    template = builtin("chatml")
    messages = [*CHAT, *TOOL_TURNS[1:]]
    prompt = template.render(messages, tools=TOOLS_SPEC)
    assert prompt_add_special_tokens(tok, prompt)
    ids = encode_prompt(tok, prompt)
    assert ids[0] == tok.bos_token_id
    anatomy = prompt_anatomy(template, tok, messages, tools=TOOLS_SPEC)
    assert anatomy.total == len(ids)
    assert min(anatomy.system, anatomy.tools, anatomy.history, anatomy.latest_user,
               anatomy.template) > 0
    without = prompt_anatomy(template, tok, messages)
    assert without.tools == 0
    assert without.total < anatomy.total
    assert anatomy.tools >= n_tokens(tok, json.dumps(TOOLS_SPEC[0]))


def test_tool_call_arguments_count_as_history(tok):
    template = builtin("chatml")
    inputs = ChatInputs.from_request(TOOL_TURNS, tools=TOOLS_SPEC)
    prompt = template.render_inputs(inputs)
    labels = label_prompt(template, inputs, prompt)
    args = prompt.index('{"city": "Paris"}')
    assert set(labels[args:args + len('{"city": "Paris"}')]) == {HISTORY}
    assert TOOLS in labels


def test_markup_written_only_for_tools_counts_as_tools_but_arguments_as_history():
    template = ChatTemplate(
        "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if tools %}{% for c in m.tool_calls or [] %}\n<tool_call>{\"name\": "
        "\"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
        "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}", "request")
    inputs = ChatInputs.from_request(TOOL_TURNS, tools=TOOLS_SPEC)
    prompt = template.render_inputs(inputs)
    labels = label_prompt(template, inputs, prompt)

    def label_of(text: str) -> set[int]:
        at = prompt.rindex(text)
        return set(labels[at:at + len(text)])

    assert label_of("Tools: ") == label_of("<tool_call>") == label_of("</tool_call>") == {TOOLS}
    assert label_of('{"city": "Paris"}') == label_of("get_weather\"") - {TOOLS} == {HISTORY}
    assert label_of("</tool_call><|im_end|>") == {TOOLS, TEMPLATE}


def test_anatomy_sums_exactly_when_token_bytes_cannot_be_laid_over_the_prompt(tok):
    class Opaque:
        """The same ids, but token bytes that do not spell the prompt: forces prefix encoding."""

        bos_token_id = tok.bos_token_id

        def encode(self, text, add_special_tokens=True):
            return tok.encode(text, add_special_tokens=add_special_tokens)

        def token_to_bytes(self, token_id):
            return tok.token_to_bytes(token_id) if token_id == tok.bos_token_id else b"?"

    template = builtin("gemma3")
    exact = prompt_anatomy(template, tok, CHAT)
    by_prefixes = prompt_anatomy(template, Opaque(), CHAT)
    assert by_prefixes == exact


def test_anatomy_of_a_template_that_rewrites_text_still_sums(tok):
    template = ChatTemplate("{% for m in messages %}<start_of_turn>{{ m.role }}\n"
                            "{{ m.content | upper }}<end_of_turn>\n{% endfor %}", "request")
    prompt = template.render(CHAT)
    anatomy = prompt_anatomy(template, tok, CHAT)
    assert anatomy.total == len(encode_prompt(tok, prompt))


def test_anatomy_with_continue_final_message(tok):
    template = builtin("gemma3")
    messages = [*CHAT[:3], {"role": "user", "content": "Count"},
                {"role": "assistant", "content": "One, two,"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    prompt = template.render(messages, **options)
    anatomy = prompt_anatomy(template, tok, messages, **options)
    assert anatomy.total == len(encode_prompt(tok, prompt))
    assert anatomy.latest_user == n_tokens(tok, "Count")
