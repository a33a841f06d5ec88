"""The one place a conversation becomes prompt tokens: the checkpoint's chat template (HF
`apply_chat_template`), with the tools the template may render. The server and `LLM.chat` both
call it, so an offline chat and a served one see the same prompt."""

from __future__ import annotations

from typing import Any


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
) -> list[int]:
    encoded = tokenizer.apply_chat_template(
        messages,
        tools=tools or None,  # an empty list renders as "no tools" in every template
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
    )
    # A list, or a BatchEncoding in newer transformers.
    return list(encoded if isinstance(encoded, list) else encoded["input_ids"])
