"""The agent gateway: an OpenAI chat-completions endpoint per agent episode, token-in/token-out on SGLang."""

from tidal.rollout.gateway.chat import Completion, GatewayError
from tidal.rollout.gateway.request import ChatRequest, parse_request
from tidal.rollout.gateway.server import Gateway, Session, pick_engine
from tidal.rollout.gateway.sessions import Episode, Trajectory, Turn
from tidal.rollout.gateway.tool_calls import ToolCallFormat

__all__ = [
    "ChatRequest",
    "Completion",
    "Episode",
    "Gateway",
    "GatewayError",
    "Session",
    "ToolCallFormat",
    "Trajectory",
    "Turn",
    "parse_request",
    "pick_engine",
]
