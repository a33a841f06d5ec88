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

from pagefleet.http_errors import APIError


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

    def check_sequences(self, num_prompts: int, n: int) -> int:
        """The request's sequences (prompts x n); 400 if one request could never be queued."""
        sequences = num_prompts * n
        cap = min(self.max_sequences, self.max_waiting or self.max_sequences)
        if sequences > cap:
            raise APIError(
                400,
                f"{num_prompts} prompt(s) x n={n} is {sequences} sequences; this server takes at "
                f"most {cap} per request (--max-sequences-per-request, --max-waiting-requests)",
                param="prompt" if num_prompts > 1 else "n",
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

    def __init__(self, tokenizer, limits: RequestLimits) -> None:
        self.tokenizer, self.limits = copy.deepcopy(tokenizer), limits
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def _run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True, param="prompt"):
        self.limits.check_text(text, param)
        return await self._run(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        # Every text the template may render: the contents and the names.
        texts = [m[key] for m in messages for key in ("content", "name") if key in m]
        for text in texts:
            self.limits.check_text(text, "messages")
        self.limits.check_text("".join(texts), "messages")
        try:
            out = await self._run(
                self.tokenizer.apply_chat_template,
                messages,
                tokenize=True,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as e:  # a template that rejects the conversation
            raise APIError(400, f"chat template failed: {e}", param="messages") from None
        return list(out if isinstance(out, list) else out["input_ids"])

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(self.tokenizer.decode, token_ids)
