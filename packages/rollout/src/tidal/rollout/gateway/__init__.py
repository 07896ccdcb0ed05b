"""The agent gateway: an OpenAI chat-completions endpoint per agent episode, token-in/token-out on SGLang."""

from tidal.rollout.gateway.chat import ChatRequest, Completion, GatewayError, parse_request, parse_tool_calls
from tidal.rollout.gateway.server import Gateway, Session, pick_engine
from tidal.rollout.gateway.sessions import Episode, Trajectory, Turn

__all__ = [
    "ChatRequest",
    "Completion",
    "Episode",
    "Gateway",
    "GatewayError",
    "Session",
    "Trajectory",
    "Turn",
    "parse_request",
    "parse_tool_calls",
    "pick_engine",
]
