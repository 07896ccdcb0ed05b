"""The gateway's HTTP routes (FastAPI, as SGLang's own server uses): authentication, sessions, errors."""

from __future__ import annotations

import hmac
import json
import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from tidal.rollout.gateway.chat import GatewayError
from tidal.rollout.gateway.request import parse_request
from tidal.rollout.gateway.streaming import StreamedCall

if TYPE_CHECKING:
    from tidal.rollout.gateway.server import Gateway, Session

logger = logging.getLogger(__name__)


def _error(e: GatewayError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def build_app(gateway: Gateway) -> FastAPI:
    """The ASGI app of ``gateway``: ``/s/{session}/v1/chat/completions``, ``/s/{session}/v1/models``, ``/health``."""
    app = FastAPI(title="tidal agent gateway", docs_url=None, redoc_url=None, openapi_url=None)

    def session_of(request: Request, session_id: str) -> Session:
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), gateway.api_key.encode()):
            raise GatewayError(
                401,
                "Incorrect or missing API key: send the job's key as 'Authorization: Bearer <key>' "
                "(the api_key an agent function receives)",
                code="invalid_api_key",
            )
        session = gateway.sessions.get(session_id)
        if session is None:
            raise GatewayError(
                404, f"no open session {session_id!r}: it ended or never existed", param="session", code="not_found"
            )
        return session

    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, e: GatewayError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return _error(GatewayError(e.status_code, f"{request.method} {request.url.path}: {e.detail}"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("gateway: %s %s failed", request.method, request.url.path)
        return _error(GatewayError(500, f"internal gateway error: {type(e).__name__}: {e}", kind="server_error"))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/s/{session_id}/v1/models")
    async def models(request: Request, session_id: str) -> dict:
        session_of(request, session_id)
        model = {"id": gateway.model_name, "object": "model", "created": 0, "owned_by": "tidal"}
        return {"object": "list", "data": [model]}

    @app.post("/s/{session_id}/v1/chat/completions")
    async def chat_completions(request: Request, session_id: str):
        session = session_of(request, session_id)
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise GatewayError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
        chat = parse_request(body)
        if not chat.stream:
            return (await gateway.complete(session, chat)).body()
        events = await StreamedCall(gateway, session, chat).start()
        return StreamingResponse(events, media_type="text/event-stream")

    return app
