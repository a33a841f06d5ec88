"""Minimal chat templates that render tools, in the two formats pagefleet parses: Hermes (Qwen's
`<tool_call>` blocks) and Llama 3.1's JSON. The tiny test checkpoints' own template has no
tools; tests serve them with `--chat-template` and one of these (written here, for tests)."""

from __future__ import annotations

HERMES = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions. Their signatures, within <tools></tools>:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each call, answer <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_JSON = """\
<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
To call a function, answer {"name": <name>, "parameters": <object>}. The functions:

{% for tool in tools %}{{ tool | tojson }}

{% endfor %}{% endif %}<|eot_id|>
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}\
<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}\
{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}\
{% endfor %}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

TEMPLATES = {"hermes": HERMES, "llama3_json": LLAMA3_JSON}


def tool_exchange(result: str) -> list[dict]:
    """The messages after the model called get_weather(city=Paris): its call, then the result."""
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]
