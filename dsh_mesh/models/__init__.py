"""Model providers behind one small streaming protocol: the OpenAI-compatible one, the scripted
and recording ones, and the router that picks one by model spec."""

from dsh_mesh.models._openai import OpenAIEndpoint, OpenAIProvider
from dsh_mesh.models._protocol import (
    CallPurpose,
    Finished,
    FinishReason,
    ModelEvent,
    ModelProvider,
    ModelRequest,
    ModelResponse,
    ProtocolViolation,
    ProviderError,
    TextDelta,
    ToolCallEvent,
    complete,
)
from dsh_mesh.models._recording import RecordingProvider
from dsh_mesh.models._retry import RetryPolicy
from dsh_mesh.models._router import ModelRouter, check_model_spec, split_model_spec
from dsh_mesh.models._scripted import (
    PARENT,
    Action,
    Branch,
    Call,
    ExhaustTokens,
    Fail,
    Reply,
    ScriptContext,
    ScriptedProvider,
    ScriptError,
    Stall,
    arrived,
    child,
    send,
    tool,
)
from dsh_mesh.models._tool_order import tool_call_order_error, turns_of

__all__ = [
    "PARENT",
    "Action",
    "Branch",
    "Call",
    "CallPurpose",
    "ExhaustTokens",
    "Fail",
    "FinishReason",
    "Finished",
    "ModelEvent",
    "ModelProvider",
    "ModelRequest",
    "ModelResponse",
    "ModelRouter",
    "OpenAIEndpoint",
    "OpenAIProvider",
    "ProtocolViolation",
    "ProviderError",
    "RecordingProvider",
    "Reply",
    "RetryPolicy",
    "ScriptContext",
    "ScriptError",
    "ScriptedProvider",
    "Stall",
    "TextDelta",
    "ToolCallEvent",
    "arrived",
    "check_model_spec",
    "child",
    "complete",
    "send",
    "split_model_spec",
    "tool",
    "tool_call_order_error",
    "turns_of",
]
