"""Bounded work per request on the engine's API.

A request may ask for little and cost a lot: a prompt far beyond the context (tokenized before
its length is known), a list of thousands of prompts times `n`, a lone surrogate the tokenizer
chokes on. Here each is refused from cheap facts before the expensive step, and tokenization
runs on a thread of its own so that a long prompt never stalls the event loop (and with it
/health and every stream).
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pagefleet.common.http_errors import APIError
from pagefleet.engine.chat_template import render_chat


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes of text one token stands for (an upper bound: a token's raw vocab
    string is never shorter than the text it decodes to, byte-level or SentencePiece)."""
    vocab = tokenizer.get_vocab()
    return max((len(token.encode("utf-8")) for token in vocab), default=1)


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    max_token_bytes: int  # see max_token_bytes()
    max_sequences: int  # prompts x n in one request
    max_waiting: int | None  # --max-waiting-requests, in sequences

    @property
    def max_prompt_bytes(self) -> int:
        """Text longer than this has more than max_model_len tokens, whatever it says."""
        return self.max_model_len * self.max_token_bytes

    def check_text(self, text: str, param: str) -> None:
        """400 for text the tokenizer cannot take or that cannot fit, without tokenizing it."""
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            raise APIError(
                400, "text is not valid Unicode (a lone surrogate)", param=param
            ) from None
        if size > self.max_prompt_bytes:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"{param} ({size} bytes) has more than that.",
                param=param,
            )

    def check_sequences(self, num_prompts: int, n: int, param: str | None = None) -> int:
        """The request's sequences (prompts x n); 400 if one request could never be queued
        (`param`: the field to name, by default the prompt or n)."""
        sequences = num_prompts * n
        cap = min(self.max_sequences, self.max_waiting or self.max_sequences)
        if sequences > cap:
            raise APIError(
                400,
                f"{num_prompts} prompt(s) x n={n} is {sequences} sequences; this server takes at "
                f"most {cap} per request (--max-sequences-per-request, --max-waiting-requests)",
                param=param or ("prompt" if num_prompts > 1 else "n"),
            )
        return sequences

    def check_capacity(self, waiting: int, sequences: int) -> None:
        """503 when the request's sequences would overflow the waiting queue."""
        if self.max_waiting is not None and waiting + sequences > self.max_waiting:
            raise APIError(
                503,
                f"the waiting queue is full ({self.max_waiting} sequences); retry later",
                "service_unavailable",
                headers={"Retry-After": "1"},
            )


class Tokenization:
    """A copy of the server's tokenizer on one thread of its own (HF fast tokenizers must not
    be shared between threads: the event loop keeps the original to render logprobs, the
    engine thread has its own). Text is checked before it is queued."""

    def __init__(self, tokenizer, limits: RequestLimits, chat_template: str | None = None):
        self.tokenizer, self.limits = copy.deepcopy(tokenizer), limits
        self.chat_template = chat_template  # None: the checkpoint's
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def _run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True, param="prompt"):
        self.limits.check_text(text, param)
        return await self._run(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def encode_many(
        self, texts: list[str], add_special_tokens: bool, param: str, check: bool = True
    ) -> list[list[int]]:
        """Several texts in one trip to the thread (one batched tokenizer call); each checked
        first unless `check` is False (the caller bounds their size another way)."""
        if check:
            for i, text in enumerate(texts):
                self.limits.check_text(text, f"{param}[{i}]" if len(texts) > 1 else param)
        encoded = await self._run(self.tokenizer, texts, add_special_tokens=add_special_tokens)
        return encoded["input_ids"]

    async def chat(
        self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
    ) -> list[int]:
        # Every text the template may render: contents, names, tool calls, the tools.
        texts = [t for m in messages for t in _strings(m)]
        for text in texts:
            self.limits.check_text(text, "messages")
        tool_texts = [t for tool in tools or () for t in _strings(tool)]
        for text in tool_texts:
            self.limits.check_text(text, "tools")
        self.limits.check_text("".join(texts + tool_texts), "messages")
        try:
            return await self._run(
                render_chat,
                self.tokenizer,
                messages,
                add_generation_prompt,
                tools,
                self.chat_template,
            )
        except Exception as e:  # a template that rejects the conversation
            raise APIError(400, f"chat template failed: {e}", param="messages") from None

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(self.tokenizer.decode, token_ids)


def _strings(value) -> list[str]:
    """Every string (keys too) in plain JSON data, iteratively."""
    out, stack = [], [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    return out
