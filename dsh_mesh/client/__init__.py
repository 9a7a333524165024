"""An asyncio client of a dsh-mesh cluster: ``MeshControl`` (create a root, prompt, interrupt,
read, watch, list), health, and ``run``/``wait`` (a task's answer once its tree has settled),
over gRPC to any one node (docs/python.md).

:class:`MeshClient` speaks the dataclasses below, never ``*_pb2`` messages, and raises the typed
:class:`~dsh_mesh.core.MeshError` of the one error table (its ``RejectionReason`` says why).
Humans are not agents: nothing here sends an agent message. Against a mutual-TLS cluster, pass
``tls=TlsCredentials.from_files(cert, key, ca)`` (a client certificate from ``dsh-mesh certs
client``).
"""

from dsh_mesh.client._client import (
    DEFAULT_CLIENT_NAME,
    TOKEN_ENV,
    ClientClosed,
    ClientOptions,
    MeshClient,
)
from dsh_mesh.client._json import BODY_TYPE, to_jsonable
from dsh_mesh.client._run import RunResult
from dsh_mesh.client._types import (
    AgentMessage,
    AgentPage,
    AgentState,
    AgentSummary,
    ApprovalDecided,
    ApprovalRequest,
    AssistantStep,
    Compaction,
    Consumed,
    DecisionResult,
    EntryBody,
    ForkPrefix,
    HealthStatus,
    HumanPrompt,
    InterruptResult,
    PendingApproval,
    PromptAccepted,
    RootSession,
    SessionEvent,
    SessionInfo,
    SessionPage,
    SettlementNotice,
    StopResult,
    StoreHealth,
    Task,
    TextDelta,
    ToolOutputsCleared,
    ToolResult,
    TranscriptEntry,
    TurnEnded,
    TurnStarted,
    UnknownEntry,
)
from dsh_mesh.transport import TlsCredentials

__all__ = [
    "BODY_TYPE",
    "DEFAULT_CLIENT_NAME",
    "TOKEN_ENV",
    "AgentMessage",
    "AgentPage",
    "AgentState",
    "AgentSummary",
    "ApprovalDecided",
    "ApprovalRequest",
    "AssistantStep",
    "ClientClosed",
    "ClientOptions",
    "Compaction",
    "Consumed",
    "DecisionResult",
    "EntryBody",
    "ForkPrefix",
    "HealthStatus",
    "HumanPrompt",
    "InterruptResult",
    "MeshClient",
    "PendingApproval",
    "PromptAccepted",
    "RootSession",
    "RunResult",
    "SessionEvent",
    "SessionInfo",
    "SessionPage",
    "SettlementNotice",
    "StopResult",
    "StoreHealth",
    "Task",
    "TextDelta",
    "TlsCredentials",
    "ToolOutputsCleared",
    "ToolResult",
    "TranscriptEntry",
    "TurnEnded",
    "TurnStarted",
    "UnknownEntry",
    "to_jsonable",
]
