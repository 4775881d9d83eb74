"""The sites' door to a SuperLink: the Fleet API and nothing else.

Flower 1.42's `flower-superlink` serves its three HTTP APIs on one address (`--host`, `--port`): the Fleet API
(`/v1/fleet/...`, what a SuperNode calls), the Control API (`/v1/control/...`: register SuperNode keys, list runs,
read logs, run and stop) and the Runtime API (`/v1/runtime/...`, the ServerAppIo of the SuperLink's SuperExec and
ServerApp). Its `--fleet-api-address` and `--control-api-address` are deprecated, and its Control API's account
authentication is OIDC, available only in Flower's enterprise distribution (`FLWR_OIDC_ENABLED=1` exits "OIDC
account authentication is unavailable in this Flower distribution"). A site that can reach that address can
therefore drive the Control API.

So the SuperLink binds the operator's side (127.0.0.1 by default), and this gate binds the sites' interface: it
forwards a POST under `/v1/fleet/` to the SuperLink (headers and body as they are, so SuperNode authentication, a
signed timestamp, passes through) and answers every other path 404 without forwarding it. TLS on the sites' side
with the SuperLink's own certificate; TLS to the SuperLink with its CA.
"""

from __future__ import annotations

import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass

FLEET_PREFIX = "/v1/fleet/"
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "host", "content-length"}


@dataclass(frozen=True)
class GateConfig:
    """Where the gate listens (the sites' side) and the SuperLink it forwards to (the operator's side)."""

    listen: str  # host:port on the sites' interface
    superlink: str  # host:port of flower-superlink, bound to the operator's side
    root_certificates: str = ""  # the SuperLink's CA ("" = the SuperLink runs --insecure)
    ssl_certfile: str = ""  # the gate's TLS certificate and key towards the sites ("" = no TLS: loopback only)
    ssl_keyfile: str = ""


def gate_app(cfg: GateConfig):
    """The ASGI app: `/v1/fleet/<endpoint>` forwarded, every other path 404."""
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    scheme = "https" if cfg.root_certificates else "http"
    client = httpx.AsyncClient(
        base_url=f"{scheme}://{cfg.superlink}", verify=cfg.root_certificates or False, timeout=None
    )

    async def forward(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        try:
            reply = await client.post(request.url.path, content=await request.body(), headers=headers)
        except httpx.HTTPError as e:
            print(f"fleet gate: the SuperLink at {cfg.superlink} did not answer: {e}", file=sys.stderr, flush=True)
            return Response(status_code=502)
        kept = {k: v for k, v in reply.headers.items() if k.lower() not in HOP_BY_HOP | {"content-encoding"}}
        return Response(reply.content, status_code=reply.status_code, headers=kept)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    return Starlette(routes=[Route(FLEET_PREFIX + "{endpoint:path}", forward, methods=["POST"])], lifespan=lifespan)


def serve_gate(cfg: GateConfig) -> None:
    """Serve the gate until SIGTERM or SIGINT (uvicorn's own handling)."""
    import uvicorn

    host, _, port = cfg.listen.rpartition(":")
    uvicorn.run(
        gate_app(cfg),
        host=host.strip("[]"),
        port=int(port),
        ssl_certfile=cfg.ssl_certfile or None,
        ssl_keyfile=cfg.ssl_keyfile or None,
        log_level="warning",
    )
