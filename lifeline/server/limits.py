"""The caps on what one request may ask for, in one place. Past a cap the request gets a 400
that names the field (`lifeline.server.protocol`); within the caps, the work a request costs
before it reaches the engine is bounded, and whatever grows with it runs off the event loop."""
from __future__ import annotations

from lifeline.engine.sampling_params import SEED_RANGE

MAX_LOGIT_BIAS = 300
"""Entries of `logit_bias` (OpenAI's and vLLM's limit)."""
MAX_STOP = 16
"""Strings in `stop`."""
MAX_STOP_CHARS = 1024
"""Characters of one `stop` string."""
MAX_STOP_TOKEN_IDS = 256
"""Token ids in `stop_token_ids`."""
MAX_LOGPROBS = 20
"""`top_logprobs` (chat) and `logprobs` (completions): alternatives per position."""
MAX_PROMPTS = 256
"""Prompts in one `/v1/completions` request (a list of strings or of token-id lists)."""
MAX_CHOICES = 256
"""Engine requests one HTTP request becomes: prompts times `n`."""
MAX_PROMPT_CHARS = 1 << 18
"""Characters of text prompt in one request, all prompts together (for chat: every string a
template may render, i.e. all message fields, tool-call arguments and reasoning included, and
`chat_template_kwargs`), and of a `/tokenize` prompt: 8 characters a token over a 32k context.
Tokenizing one long text builds millions of small objects, and the collector's passes over them
stop the process. What a template renders from them is capped again, as a whole
(`lifeline.chat.RenderLimits.max_prompt_chars`)."""
MAX_PROMPT_TOKEN_IDS = 1 << 17
"""Token ids of prompt in one request, all prompts together (and of a `/detokenize` list)."""
MAX_MESSAGES = 2048
"""Messages of a chat request (and of a `/tokenize` request)."""
MAX_TOOLS = 128
"""Tools of a chat request (OpenAI's limit)."""
MAX_TOOLS_CHARS = 1 << 18
"""Size of the `tools` list, counted as the characters of its strings plus one per value."""
SEED_MIN, SEED_MAX = SEED_RANGE
"""`seed` is a signed 64-bit integer (the engine's own check)."""
INLINE_JSON_COMMAS = 1024
"""A body with more commas than this (a bound on its JSON values) is parsed and validated in a
worker thread by the pure-Python scanner, which lets the event loop run; smaller ones are
parsed on the loop by the C one, whose cost is bounded by this count (at 8,192, a chat of
2,048 messages was parsed and validated on the loop in 34 ms, 60-90 ms beside the preparing
thread: `/health` waited that long)."""
INLINE_BODY_BYTES = 4096
"""A generation or tokenizer request whose body is at most this size is templated, tokenized
and checked on the event loop (its cost is bounded by the size); larger ones in a thread."""
