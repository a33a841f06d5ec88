"""Request and response bodies of the OpenAI-compatible API (the fields we support).

Every declared field is honoured. OpenAI and vLLM fields that this server does not implement
are refused with a 400 naming them when a request sets them to anything but their default
(`UNSUPPORTED_FIELDS`), so a client never gets silently different behaviour; other unknown
fields are accepted and ignored, as vLLM does, but counted and logged (`ignored_fields`). Wrong
types and out-of-range values are 400s.
docs/testing.md lists every field and what happens to it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from pagefleet.engine.sampling_params import SamplingParams, StructuredOutputsParams
from pagefleet.engine.server.tools import (
    MAX_ID_CHARS,
    MAX_TOOL_CALLS,
    MessageToolCall,
    NamedToolChoice,
    Tool,
    ToolChoice,
    check_tools,
    constraint_for,
)

# Bounds on what a client may ask a grammar to be (every port is hostile): the text of a
# schema, regex or grammar, and the number and size of choices.
MAX_CONSTRAINT_CHARS = 64 * 1024
MAX_CHOICES = 256
MAX_LOGIT_BIAS = 300
# Unknown fields that get their own label on the ignored-fields counter (names clients of
# OpenAI's API commonly send); every other unknown name counts as "other", so a client cannot
# grow the metric's label set.
KNOWN_IGNORED_FIELDS = frozenset(
    {
        "metadata",
        "store",
        "service_tier",
        "reasoning_effort",
        "verbosity",
        "safety_identifier",
        "prompt_cache_key",
        "web_search_options",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
    }
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage on every chunk (vLLM); needs include_usage

    @model_validator(mode="after")
    def _continuous_needs_usage(self):
        if self.continuous_usage_stats and not self.include_usage:
            # vLLM drops it silently in this case; we say so instead.
            raise ValueError("stream_options.continuous_usage_stats needs include_usage: true")
        return self


# Fields of OpenAI's or vLLM's API that we do not implement, with the values that mean "not
# used" (what clients send by default). Anything else is a 400 naming the field.
_OFF = (None, False, [], {}, "")
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "suffix": _OFF,
    "best_of": (*_OFF, 1),
    "use_beam_search": _OFF,
    "length_penalty": (None, 1, 1.0),
    "allowed_token_ids": _OFF,
    "bad_words": _OFF,
    "logprob_token_ids": _OFF,
    "truncate_prompt_tokens": _OFF,
    "return_tokens_as_token_ids": _OFF,
    "return_token_ids": _OFF,
    "prompt_embeds": _OFF,
    "cache_salt": _OFF,
    "priority": (None, 0),
    "spaces_between_special_tokens": (None, True),
    "functions": _OFF,  # OpenAI's deprecated form of tools
    "function_call": (*_OFF, "none"),
    "audio": _OFF,
    "modalities": (*_OFF, ["text"]),
    "prediction": _OFF,
    "chat_template": _OFF,
    "chat_template_kwargs": _OFF,
    "continue_final_message": _OFF,
    "documents": _OFF,
    "mm_processor_kwargs": _OFF,
    "vllm_xargs": _OFF,
}


def refuse_unsupported(
    data: Any, extra: dict[str, tuple] | None = None, base: dict[str, tuple] = UNSUPPORTED_FIELDS
) -> Any:
    """A 400 (via ValueError) naming the first unsupported field set to a non-default value."""
    if isinstance(data, dict):
        for name, off in (base | (extra or {})).items():
            if name in data and not any(_same(data[name], v) for v in off):
                raise ValueError(f"{name} is not supported by this server")
    return data


def _same(value: Any, off: Any) -> bool:
    # `False == 0` in Python: compare types too, so `priority: false` is not "0".
    return value is off or (type(value) is type(off) and value == off)


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("response", max_length=256)
    description: str | None = None
    # OpenAI's field name is "schema", which pydantic's BaseModel reserves.
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # enforced either way: the grammar is the schema


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: json_schema is given exactly with type json_schema")
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's structured_outputs request field (one constraint)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingFields(BaseModel):
    # Unknown fields are kept (not used) so the server can count and log them; see
    # ignored_fields().
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    kv_transfer_params: dict[str, Any] | None = None  # disaggregated prefill/decode (vLLM)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM: per prompt token, top-k
    user: str | None = None  # OpenAI's end-user id for abuse monitoring: no effect on output
    # Structured outputs (OpenAI's response_format; vLLM's structured_outputs and its older
    # guided_* fields) and OpenAI's logit_bias.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _check_stop(self):
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true")
        self.structured_constraint()  # raises on a bad or oversized constraint
        self.engine_logit_bias()
        return self

    def ignored_fields(self) -> list[str]:
        """Fields the request set that this server neither declares nor refuses."""
        return sorted(set(self.model_extra or ()) - set(UNSUPPORTED_FIELDS) - {"echo"})

    def engine_logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias (token id strings -> bias in [-100, 100]) as ids."""
        if not self.logit_bias:
            return None
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries")
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isdigit() or len(key) > 12:
                raise ValueError(f"logit_bias: keys are token ids, got {key[:32]!r}")
            if not -100 <= value <= 100:
                raise ValueError("logit_bias: biases must be in [-100, 100]")
            bias[int(key)] = value
        return bias

    def structured_constraint(self) -> StructuredOutputsParams | None:
        """The one output constraint the request sets, from whichever field sets it."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            schema = _schema_text("response_format.json_schema.schema", rf.json_schema.json_schema)
            found.append(("response_format", StructuredOutputsParams(json=schema)))
        so = self.structured_outputs
        if so is not None:
            found.append(
                (
                    "structured_outputs",
                    _constraint(
                        "structured_outputs",
                        so.json_,
                        so.json_object,
                        so.regex,
                        so.choice,
                        so.grammar,
                    ),
                )
            )
        guided = (self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar)
        names = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        for name, value in zip(names, guided, strict=True):
            if value is not None:
                kwargs = {"json": None, "regex": None, "choice": None, "grammar": None}
                kwargs[name.removeprefix("guided_")] = value
                found.append((name, _constraint(name, json_object=None, **kwargs)))
        if len(found) > 1:
            raise ValueError(
                "give one output constraint; got " + ", ".join(name for name, _ in found)
            )
        return found[0][1] if found else None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens  # declared by each request type

    def engine_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        # min_tokens above the server's own max_tokens (what the context leaves) is cut to it;
        # above the client's max_tokens it is an error, as in vLLM.
        min_tokens = self.min_tokens
        if self.requested_max_tokens() is None:
            min_tokens = min(min_tokens, max_tokens)
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            # The engine samples at least one token; an echo with max_tokens 0 drops it.
            max_tokens=max(max_tokens, 1),
            min_tokens=min_tokens,
            stop=stops,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.engine_prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            kv_transfer_params=self.kv_transfer_params,
            structured_outputs=self.structured_constraint(),
            logit_bias=self.engine_logit_bias(),
        )


def _schema_text(field: str, schema: dict[str, Any] | str) -> str:
    """A JSON schema as canonical JSON text (the grammar cache's key), size-bounded."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise ValueError(f"{field}: not valid JSON") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{field}: a JSON schema must be an object")
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    _check_size(field, text)
    return text


def _check_size(field: str, text: str) -> None:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"{field}: at most {MAX_CONSTRAINT_CHARS} characters")


def _constraint(field: str, json, json_object, regex, choice, grammar) -> StructuredOutputsParams:
    """StructuredOutputsParams from one field's parts, bounded; exactly one part set."""
    if regex is not None:
        _check_size(field, regex)
    if grammar is not None:
        _check_size(field, grammar)
    if choice is not None:
        if not choice or len(choice) > MAX_CHOICES:
            raise ValueError(f"{field}: choice needs 1 to {MAX_CHOICES} strings")
        if any(not c for c in choice):
            raise ValueError(f"{field}: choices must not be empty")
        _check_size(field, "".join(choice))
    try:
        return StructuredOutputsParams(
            json=_schema_text(field, json) if json is not None else None,
            json_object=bool(json_object),
            regex=regex,
            choice=tuple(choice) if choice is not None else None,
            grammar=grammar,
        )
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 only with echo: the prompt's logprobs and no completion (vLLM's scoring request).
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt (and, with logprobs, its logprobs) before the completion
    add_special_tokens: bool = True  # vLLM: BOS etc. when tokenizing a text prompt

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data)

    @model_validator(mode="after")
    def _check_prompt(self):
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo)")
        return self

    def engine_prompt_logprobs(self) -> int | None:
        """Asked for, or echoed with the completion's logprobs (as vLLM does)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = Field(None, max_length=MAX_ID_CHARS)  # a tool result's call

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, {"audio": _OFF})

    @model_validator(mode="after")
    def _calls_from_assistant(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    @model_validator(mode="after")
    def _text_parts_only(self):
        if isinstance(self.content, list):
            kinds = {p.get("type") for p in self.content} - {"text"}
            if kinds:
                raise ValueError(
                    f"content parts of type {sorted(map(str, kinds))} are not supported (text only)"
                )
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            return "".join(parts)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (name, tool calls and call id when given)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    # Default (as OpenAI and vLLM): "auto" when tools are given, else "none".
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, {"echo": _OFF})

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _check_tools(self):
        if self.tools is not None:
            check_tools(self.tools)
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
        elif self.tool_choice == "required" and self.tools == []:
            self.tool_choice = "none"  # as OpenAI (and vLLM): nothing to require
        elif self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if all(t.function.name != name for t in self.tools):
                raise ValueError(f"tool_choice names {name!r}, which is not one of the tools")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """A required or named tool choice constrains the output to its call's JSON."""
        params = super().sampling_params(max_tokens, logprobs)
        constraint = constraint_for(
            self.tools, self.tool_choice, self.parallel_tool_calls is not False
        )
        if constraint is None:
            return params
        if params.structured_outputs is not None:
            raise ValueError(
                "tool_choice required or a named function cannot be combined with "
                "response_format or structured outputs"
            )
        return dataclasses.replace(params, structured_outputs=constraint)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for a prompt; a chat template adds its own
    add_generation_prompt: bool = True  # for messages
    tools: list[Tool] | None = None  # rendered with the messages, as in a chat request

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and "add_special_tokens" in self.model_fields_set:
            raise ValueError("add_special_tokens applies to a prompt, not to messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


# OpenAI's limit on the inputs of one embeddings request (the pydantic bound stops a longer list
# before any work; the server's --max-sequences-per-request can lower it).
MAX_EMBEDDING_INPUTS = 2048
TokenIds = list[Annotated[StrictInt, Field(ge=0)]]
# vLLM's embedding fields we do not implement, with their "not used" values: chat-shaped input,
# unnormalised output of a normalising model, other output dtypes and byte orders.
EMBEDDING_UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "messages": _OFF,
    "normalize": (None, True),
    "use_activation": (None, True),
    "embed_dtype": (None, "float32"),
    "endianness": (None, "native", "little"),
    "priority": (None, 0),
    "mm_processor_kwargs": _OFF,
}


class EmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings body (and vLLM's /pooling, which adds `task`): one input or a
    list of them, as text or token ids."""

    model_config = ConfigDict(extra="allow")  # counted and logged, as for completions

    model: str | None = None
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]  # see _check_input_shape
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # Matryoshka width, where the model declares it
    user: str | None = None  # OpenAI's end-user id: no effect on the vectors
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM: keep the last k tokens
    add_special_tokens: bool = True  # vLLM: the tokenizer's specials around a text input
    task: Literal["embed"] | None = None  # /pooling only (vLLM): the one task served

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, base=EMBEDDING_UNSUPPORTED_FIELDS)

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        _check_input_shape(value)
        return value

    @model_validator(mode="after")
    def _check_truncation(self):
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1")
        return self

    def ignored_fields(self) -> list[str]:
        return sorted(set(self.model_extra or ()) - set(EMBEDDING_UNSUPPORTED_FIELDS))

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text, or token ids."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if all(isinstance(x, int) for x in given):
            return [list(given)]
        return list(given)


def _check_input_shape(value: Any) -> None:
    """One of the four shapes, and at most MAX_EMBEDDING_INPUTS inputs, checked in one pass
    before pydantic's (whose union errors would name its branches, not the problem)."""
    if isinstance(value, str):
        return
    if not isinstance(value, list) or not value:
        raise ValueError("input must be a string or a non-empty list")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise ValueError(
            f"input has {len(value)} items; at most {MAX_EMBEDDING_INPUTS} per request"
        )
    shapes = {_item_shape(item) for item in value}
    if len(shapes) != 1 or None in shapes:
        raise ValueError(
            "input must be a string, a list of strings, a list of token ids or a list of "
            "non-empty lists of token ids (one kind per request)"
        )


def _item_shape(item: Any) -> str | None:
    if isinstance(item, str):
        return "text"
    if _is_token_id(item):
        return "id"
    if isinstance(item, list) and item and all(_is_token_id(t) for t in item):
        return "ids"
    return None


def _is_token_id(value: Any) -> bool:
    return type(value) is int and value >= 0  # bool is an int subclass: not an id
