"""Tool calling's request side: the `tools`, `tool_choice` and message `tool_calls` bodies with
their bounds, the tools as chat templates read them, and the structured-output schema that
`tool_choice: required` or a named function constrains the output to (as vLLM builds it).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagefleet.engine.sampling_params import StructuredOutputsParams

# Bounds on what a client may send (OpenAI's own limits where it has them: 128 tools, names
# of 64 characters from [A-Za-z0-9_-]). Deep or huge schemas cost template rendering, grammar
# compilation and prompt tokens; the request body limit bounds the rest.
MAX_TOOLS = 128
MAX_TOOLS_BYTES = 512 << 10  # the tools as JSON, all together
MAX_SCHEMA_DEPTH = 32
MAX_TOOL_CALLS = 128  # in one assistant message
MAX_ID_CHARS = 256
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def json_depth(value: Any) -> int:
    """Nesting depth of plain JSON data (iterative: a deep value must not blow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_SCHEMA_DEPTH:
                return depth
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return deepest


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # OpenAI's; the schema is enforced only for required/named

    @field_validator("parameters")
    @classmethod
    def _bounded_schema(cls, value):
        if value is not None and json_depth(value) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"parameters nest deeper than {MAX_SCHEMA_DEPTH} levels")
        return value


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict:
        """The OpenAI shape chat templates take (HF `apply_chat_template(tools=...)`)."""
        function = {"name": self.function.name}
        if self.function.description is not None:
            function["description"] = self.function.description
        function["parameters"] = self.function.parameters or EMPTY_PARAMETERS
        return {"type": "function", "function": function}


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=NAME_PATTERN)
    arguments: str  # JSON text of an object, as the API returned it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except ValueError:
            raise ValueError("arguments must be the JSON text of an object") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be the JSON text of an object")
        if json_depth(parsed) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"arguments nest deeper than {MAX_SCHEMA_DEPTH} levels")
        return value


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (sent back in the conversation)."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict:
        # HF templates (Qwen, Llama 3.1) render arguments with `tojson`: a dict, as vLLM
        # passes them, not the JSON string the API carries.
        return {
            "id": self.id,
            "type": "function",
            "function": {
                "name": self.function.name,
                "arguments": json.loads(self.function.arguments),
            },
        }


def check_tools(tools: list[Tool]) -> None:
    """Bounds across the list (each tool is checked by its model)."""
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tool names must be unique")
    size = len(json.dumps([t.for_template() for t in tools]).encode())
    if size > MAX_TOOLS_BYTES:
        raise ValueError(f"tools take {size} bytes as JSON; at most {MAX_TOOLS_BYTES}")


# ------------------------------------------------------------------ constrained choices


def named_schema(tools: list[Tool], name: str) -> dict:
    """A named function: the output is its arguments object."""
    tool = next(t for t in tools if t.function.name == name)
    return copy.deepcopy(tool.function.parameters) or dict(EMPTY_PARAMETERS)


def required_schema(tools: list[Tool], parallel_tool_calls: bool = True) -> dict:
    """`tool_choice: required`: a JSON array of at least one `{"name", "parameters"}` object,
    each the name of a declared tool with arguments valid for it. Each tool's `$defs` move to
    the top, where its `#/$defs/...` references now resolve; two tools defining one name
    differently cannot share it (a 400)."""
    defs: dict[str, Any] = {}
    alternatives = []
    for tool in tools:
        parameters = copy.deepcopy(tool.function.parameters) or dict(EMPTY_PARAMETERS)
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"tools define $defs/{name} differently")
        alternatives.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                # Nothing else (vLLM leaves this open): grammar engines that allow unknown
                # keys by default would let a model ramble inside a call.
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": alternatives},
    }
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def constraint_for(
    tools: list[Tool] | None, tool_choice: ToolChoice, parallel_tool_calls: bool
) -> StructuredOutputsParams | None:
    """The structured output a tool choice needs (none for `none` and `auto`)."""
    if not tools:
        return None
    if isinstance(tool_choice, NamedToolChoice):
        schema = named_schema(tools, tool_choice.function.name)
    elif tool_choice == "required":
        schema = required_schema(tools, parallel_tool_calls)
    else:
        return None
    return StructuredOutputsParams(json=json.dumps(schema, sort_keys=True, separators=(",", ":")))
