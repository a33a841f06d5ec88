"""Pieces of OpenAI-shaped responses, as vLLM's server builds them: the completions logprobs
object, `echo` (the prompt and its logprobs before the completion), prompt logprobs, and usage
(at the end, or on every chunk with `stream_options.continuous_usage_stats`).

Pure functions of engine outputs; the handlers in app.py call them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagefleet.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagefleet.engine.server.protocol import CompletionRequest

# What vLLM sends for a logprob of -inf (JSON has no infinity).
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class EchoedPrompt:
    """The prompt as an echoing choice starts: its text, tokens and logprobs (the first token's
    is None: nothing comes before it). `alone`: max_tokens 0, the completion is dropped."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None
    alone: bool


@dataclass(frozen=True)
class ChoicePart:
    """What one choice (or one stream chunk of it) carries."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None


def echoed_prompt(
    req: CompletionRequest, prompt: str | list[int], out: RequestOutput, tokenizer
) -> EchoedPrompt | None:
    """The echo for one prompt of the request, or None without `echo`."""
    if not req.echo:
        return None
    text = prompt if isinstance(prompt, str) else tokenizer.decode(out.prompt_token_ids)
    return EchoedPrompt(text, list(out.prompt_token_ids), out.prompt_logprobs, req.max_tokens == 0)


def choice_part(
    c: CompletionOutput, chars: int = 0, tokens: int = 0, echo: EchoedPrompt | None = None
) -> ChoicePart:
    """The choice's text, tokens and logprobs after `chars` characters and `tokens` tokens,
    with the echoed prompt in front (a stream sends it with the choice's first chunk only)."""
    entries = c.logprobs[tokens:] if c.logprobs is not None else None
    part = ChoicePart(c.text[chars:], c.token_ids[tokens:], entries)
    if echo is None:
        return part
    if echo.alone:
        return ChoicePart(echo.text, echo.token_ids, echo.logprobs)
    logprobs = None
    if entries is not None:
        prompt = echo.logprobs or [None] * len(echo.token_ids)
        logprobs = [*prompt, *entries]
    return ChoicePart(echo.text + part.text, echo.token_ids + part.token_ids, logprobs)


def completion_logprobs(
    entries: list[TokenLogprobs | None] | None,
    token_ids: list[int],
    tokenizer,
    first_offset: int = 0,
) -> dict | None:
    """OpenAI's completions `logprobs` object (None without entries). An entry of None (the
    first prompt token of an echo) gives None for its logprob and top logprobs, as in vLLM."""
    if entries is None:
        return None
    texts = [tokenizer.decode([t]) for t in token_ids]
    offsets, pos = [], first_offset
    for text in texts:
        offsets.append(pos)
        pos += len(text)
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    for entry, token in zip(entries, token_ids, strict=True):
        if entry is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(_finite(entry[token].logprob))
        top.append({tokenizer.decode([t]): _finite(lp.logprob) for t, lp in entry.items()})
    return {
        "tokens": texts,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def next_text_offset(logprobs: dict, offset: int) -> int:
    """Where the next chunk's first token starts, after this chunk's `logprobs` object."""
    if not logprobs["tokens"]:
        return offset
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def prompt_logprobs_json(entries: list[TokenLogprobs | None] | None, tokenizer) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}}."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {
                "logprob": _finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": tokenizer.decode([t]),
            }
            for t, lp in entry.items()
        }
        for entry in entries
    ]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def continuous_usage(req, prompt_tokens: int, completion_tokens: int) -> dict:
    """`{"usage": ...}` for a stream chunk when the client asked for usage on every chunk (the
    tokens of that choice so far), else nothing."""
    options = req.stream_options
    if options is None or not options.continuous_usage_stats:
        return {}
    return {"usage": usage(prompt_tokens, completion_tokens)}


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR) if not math.isnan(logprob) else LOGPROB_FLOOR
