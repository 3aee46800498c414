"""Request fields of OpenAI's tool calling, validated with pydantic: tool definitions, ``tool_choice``,
``parallel_tool_calls``, and the assistant ``tool_calls`` of a conversation's history."""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: OpenAI's limits: function names, tools per request.
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128
TOOL_CHOICES = ("none", "auto", "required")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="a JSON Schema object")
    strict: Optional[bool] = Field(None, description="true: a call's arguments follow parameters exactly (constrained decoding)")


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str = Field(..., pattern=FUNCTION_NAME)


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    name: str = Field(..., min_length=1)
    arguments: str = Field(..., description="the arguments as a JSON object, serialized")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            value = json.loads(v) if v.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"arguments are not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("arguments must be a JSON object")
        return v


class ToolCall(BaseModel):
    """A call an assistant made earlier in the conversation."""

    id: str = Field(..., min_length=1)
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolMessageFields(BaseModel):
    """The tool-calling fields of a chat message: an assistant's ``tool_calls``, a tool result's ``tool_call_id``."""

    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = Field(None, min_length=1)
    name: Optional[str] = None

    @model_validator(mode="after")
    def _by_role(self) -> "ToolMessageFields":
        role = getattr(self, "role", None)
        if role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_calls and role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class ToolRequestFields(BaseModel):
    """The tool-calling fields of a chat completion request."""

    tools: Optional[list[ToolDefinition]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Optional[Union[str, NamedToolChoice]] = Field(
        None, description='"none", "auto" (the default), "required" or {"type": "function", "function": {"name"}}')
    parallel_tool_calls: Optional[bool] = Field(None, description="false: at most one call per choice")

    @field_validator("tool_choice")
    @classmethod
    def _known_choice(cls, v: Any) -> Any:
        if isinstance(v, str) and v not in TOOL_CHOICES:
            raise ValueError(f"{v!r} is not one of {', '.join(TOOL_CHOICES)} (or a named function)")
        return v

    functions: Optional[Any] = Field(None, description="OpenAI's deprecated form of tools: refused (send tools)")
    function_call: Optional[Any] = Field(None, description="OpenAI's deprecated form of tool_choice: refused (send "
                                                           "tool_choice)")

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, v: Any) -> Any:
        raise ValueError("functions is OpenAI's deprecated form of tools: send tools")

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, v: Any) -> Any:
        raise ValueError("function_call is OpenAI's deprecated form of tool_choice: send tool_choice")

    def tool_dicts(self) -> list[dict]:
        """The tool definitions as plain dicts (unset fields left out)."""
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    def tool_choice_value(self) -> str | dict | None:
        """``tool_choice`` as the request sent it (a string or a dict)."""
        c = self.tool_choice
        return c.model_dump() if isinstance(c, BaseModel) else c
