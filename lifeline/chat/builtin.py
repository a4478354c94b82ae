"""Built-in chat templates, used when neither the command line, the GGUF file nor the Hugging
Face directory supplies one. Each follows its family's documented prompt format.

- gemma3: https://ai.google.dev/gemma/docs/core/prompt-structure, rendered as Google's own
  template renders what it accepts. The first system message opens the first user turn,
  followed by a blank line. Turns alternate user/model; content is trimmed. A later system
  message where a model turn would be is a `system` turn, as Google's template writes it; where
  a user turn would be (Google's template refuses it there, OpenAI does not), it opens the user
  turn that follows, as the first one does, or is a user turn of its own when no user message
  follows. A lone system message becomes a user turn.
- llama: Llama 3 headers (`<|start_header_id|>role<|end_header_id|>\\n\\n…<|eot_id|>`). Tools are
  listed in the system turn; calls are written as `{"name": …, "parameters": …}`; tool results
  use the `ipython` role, as in Llama 3.1's JSON tool calling.
- chatml: `<|im_start|>role\\n…<|im_end|>\\n` (Qwen). Tools in the system turn inside `<tools>`,
  calls as Hermes `<tool_call>{"name": …, "arguments": …}</tool_call>`, tool results as
  `<tool_response>` blocks in one user turn. Reasoning of assistant turns after the last user
  message is kept in `<think>` blocks. `enable_thinking=True` opens the answer with `<think>\\n`
  (so the output starts inside reasoning); `False` closes an empty think block."""
from __future__ import annotations

GEMMA3 = r"""
{{- bos_token -}}
{%- set ns = namespace(prefix='', first=0, model=false) -%}
{%- if messages[0].role == 'system' -%}
  {%- set ns.prefix = messages[0].content ~ '\n\n' -%}
  {%- set ns.first = 1 -%}
{%- endif -%}
{%- set turns = messages[ns.first:] -%}
{%- if not turns -%}
  {{- '<start_of_turn>user\n' ~ ns.prefix | trim ~ '<end_of_turn>\n' -}}
{%- endif -%}
{%- for message in turns -%}
  {%- if not ns.model and message.role == 'system' and not loop.last
        and loop.nextitem.role == 'user' -%}
    {%- set ns.prefix = ns.prefix ~ message.content ~ '\n\n' -%}
  {%- else -%}
    {%- if message.role not in (['assistant', 'system'] if ns.model else ['user', 'system']) -%}
      {{- raise_exception('Gemma needs turns that alternate user/assistant, starting with a '
                          ~ 'user turn; a system message may stand in for either') -}}
    {%- endif -%}
    {%- if ns.model -%}
      {{- '<start_of_turn>' ~ ('model' if message.role == 'assistant' else 'system') ~ '\n' -}}
      {{- message.content | trim ~ '<end_of_turn>\n' -}}
    {%- else -%}
      {{- '<start_of_turn>user\n' ~ ns.prefix ~ message.content | trim ~ '<end_of_turn>\n' -}}
      {%- set ns.prefix = '' -%}
    {%- endif -%}
    {%- set ns.model = not ns.model -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<start_of_turn>model\n' -}}
{%- endif -%}
"""

LLAMA3 = r"""
{{- bos_token -}}
{%- set ns = namespace(first=0) -%}
{%- if tools or messages[0].role == 'system' -%}
  {{- '<|start_header_id|>system<|end_header_id|>\n\n' -}}
  {%- if messages[0].role == 'system' -%}
    {{- messages[0].content | trim -}}
    {%- set ns.first = 1 -%}
  {%- endif -%}
  {%- if tools -%}
    {{- ('\n\n' if ns.first else '') ~ 'You can call the functions below. To call one, reply '
        ~ 'with only a JSON object {"name": function name, "parameters": object of argument '
        ~ 'values}.\n\n' -}}
    {%- for tool in tools -%}
      {{- tool | tojson(indent=4) ~ ('' if loop.last else '\n\n') -}}
    {%- endfor -%}
  {%- endif -%}
  {{- '<|eot_id|>' -}}
{%- endif -%}
{%- for message in messages[ns.first:] -%}
  {%- set role = 'ipython' if message.role == 'tool' else message.role -%}
  {{- '<|start_header_id|>' ~ role ~ '<|end_header_id|>\n\n' -}}
  {%- if message.content -%}
    {{- message.content | trim -}}
  {%- endif -%}
  {%- for call in message.tool_calls or [] -%}
    {{- ('\n' if message.content or not loop.first else '') ~ '{"name": '
        ~ call.function.name | tojson ~ ', "parameters": '
        ~ call.function.arguments | tojson ~ '}' -}}
  {%- endfor -%}
  {{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"""

CHATML = r"""
{%- set ns = namespace(first=0, last_user=-1) -%}
{%- for message in messages -%}
  {%- if message.role == 'user' -%}
    {%- set ns.last_user = loop.index0 -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools or messages[0].role == 'system' -%}
  {{- '<|im_start|>system\n' -}}
  {%- if messages[0].role == 'system' -%}
    {{- messages[0].content -}}
    {%- set ns.first = 1 -%}
  {%- endif -%}
  {%- if tools -%}
    {{- ('\n\n' if ns.first else '') ~ '# Tools\n\nYou may call one or more functions to help '
        ~ 'with the user query. The function signatures are inside <tools></tools> XML tags:'
        ~ '\n<tools>' -}}
    {%- for tool in tools -%}
      {{- '\n' ~ tool | tojson -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, return a JSON object with its name and arguments '
        ~ 'inside <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
        ~ '"arguments": <arguments-json-object>}\n</tool_call>' -}}
  {%- endif -%}
  {{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[ns.first:] -%}
  {%- if message.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' -%}
      {{- '<|im_start|>user' -}}
    {%- endif -%}
    {{- '\n<tool_response>\n' ~ message.content ~ '\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}
      {{- '<|im_end|>\n' -}}
    {%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' ~ message.role ~ '\n' -}}
    {%- if message.role == 'assistant' and message.reasoning_content
          and loop.index0 + ns.first > ns.last_user -%}
      {{- '<think>\n' ~ message.reasoning_content | trim ~ '\n</think>\n\n' -}}
    {%- endif -%}
    {%- if message.content -%}
      {{- message.content -}}
    {%- endif -%}
    {%- for call in message.tool_calls or [] -%}
      {{- ('\n' if message.content or not loop.first else '') ~ '<tool_call>\n{"name": '
          ~ call.function.name | tojson ~ ', "arguments": '
          ~ call.function.arguments | tojson ~ '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}
    {{- '<think>\n\n</think>\n\n' -}}
  {%- elif enable_thinking -%}
    {{- '<think>\n' -}}
  {%- endif -%}
{%- endif -%}
"""

BUILTIN_TEMPLATES = {"gemma3": GEMMA3, "llama": LLAMA3, "chatml": CHATML}


def builtin_family(architecture: str) -> str:
    """The built-in template for a model architecture ('gemma3', 'qwen2', 'LlamaForCausalLM'…)."""
    name = architecture.lower()
    if "gemma" in name:
        return "gemma3"
    if "llama" in name or "mistral" in name:
        return "llama"
    return "chatml"
