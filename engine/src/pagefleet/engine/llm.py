"""The offline API vLLM users know: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagefleet.common.kv_events import KVEventListener
from pagefleet.engine.chat_template import render_chat
from pagefleet.engine.config import EngineArgs
from pagefleet.engine.engines import make_engine
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.outputs import PoolingRequestOutput, RequestOutput
from pagefleet.engine.pooling.params import PoolingParams
from pagefleet.engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


class LLM:
    def __init__(
        self, model: str, kv_event_listener: KVEventListener | None = None, **engine_args: Any
    ) -> None:
        self.engine = make_engine(EngineArgs(model=str(model), **engine_args), kv_event_listener)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. `lora_request`:
        the LoRA adapter of every prompt, or one per prompt (None: the base model), as vLLM's
        (an adapter not loaded yet is loaded from its path)."""
        if self.engine.limits.pooling is not None:
            raise ValueError("this model runs the pooling runner: use LLM.embed, not generate")
        return self._submit_all(
            prompts, sampling_params or SamplingParams(), use_tqdm, lora_request
        )

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt into its vector (`output.outputs.embedding`), in input order;
        needs the pooling runner (--runner pooling, or auto on an embedding checkpoint)."""
        if self.engine.limits.pooling is None:
            raise ValueError("this model runs the generate runner: embed needs runner='pooling'")
        return self._submit_all(prompts, pooling_params or PoolingParams(), use_tqdm)

    def _submit_all(self, prompts, each, use_tqdm: bool, lora_request=None) -> list:
        batch = _as_batch(prompts)
        if isinstance(each, SamplingParams | PoolingParams):
            params = [each] * len(batch)
        else:
            params = list(each)
            if len(params) != len(batch):
                raise ValueError(f"{len(params)} sets of params for {len(batch)} prompts")
        loras = _per_prompt(lora_request, len(batch))
        ids: list[str] = []
        try:
            for prompt, sp, lora in zip(batch, params, loras, strict=True):
                ids.append(self.engine.add_request(None, _unwrap(prompt), sp, lora_request=lora))
        except Exception:
            for rid in ids:  # all or nothing: drop what this call queued
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (with `tools`, OpenAI-shaped, if given) to each
        conversation, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.engine.tokenizer
        prompts = [
            render_chat(tokenizer, conv, add_generation_prompt, tools, chat_template)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
                failures = self.engine.take_failures()
                if failures:  # a grammar that failed to compile: the batch fails, as on add
                    for rid in request_ids:
                        self.engine.abort_request(rid)
                    rid, error = failures[0]
                    raise ValueError(f"request {rid}: {error}")
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in request_ids]


def _per_prompt(lora_request, count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"{len(loras)} LoRA requests for {count} prompts")
    return loras


def _as_batch(prompts) -> list[Prompt]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt given as token ids
    return prompts


def _unwrap(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]
    return prompt
