"""Who may call the server, and how much they may send: an ASGI middleware in front of the app.

In order, for every HTTP request:

1. `Host` must name this server when it is bound to loopback (or when `allowed_hosts` is
   given): a web page that re-points its own domain at 127.0.0.1 (DNS rebinding) sends
   its domain as `Host` and gets 403.
2. A browser's `Origin` must be the server itself (its `Host`: the /docs page) or one of
   `cors_origins` (none by default): 403, so a page cannot drive a local server with a
   cross-origin "simple" POST.
3. Every route but `/health` and the lab's page (`/lab`, `/lab/static/...`) needs
   `Authorization: Bearer KEY` when an API key is set: 401, the key compared in constant
   time (`hmac.compare_digest`).
4. A POST's body (to a route that takes one) must be JSON (`Content-Type: application/json`): 415, and at most
   `max_body_bytes`: 413 from `Content-Length` before anything is read, and for a body
   without one (chunked), as soon as the bytes received pass the bound.

Each refusal is an OpenAI-style error body (protocol.error_body).
"""

from __future__ import annotations

import hmac
import ipaddress
import json

from decodekit.server.protocol import APIError, error_body

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
OPEN = ("/health", "/lab")  # routes that need no API key: /lab is the lab's page, not its data
OPEN_PREFIXES = ("/lab/static/",)  # the page's script and style sheet


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_policy(bound_host: str, extra: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The `Host` names accepted by a server bound to `bound_host`, or None for any.

    A loopback server accepts the loopback names and its own; a server bound elsewhere
    (0.0.0.0: reached by names it cannot know) accepts any unless `extra` names some.
    "*" in `extra` turns the check off.
    """
    if "*" in extra or (not extra and not is_loopback(bound_host)):
        return None
    return frozenset(name.lower().strip("[]") for name in (*LOOPBACK_HOSTS, bound_host, *extra))


def host_name(header: str) -> str:
    """The name of a `Host` header without its port: "[::1]:8000" -> "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


def same_origin(origin: str, host: str | None) -> bool:
    """Whether `Origin` ("http://127.0.0.1:8000") names the `Host` the request was sent to."""
    scheme, _, netloc = origin.partition("://")
    return host is not None and scheme in ("http", "https") and netloc.lower() == host.strip().lower()


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than this server's limit of {limit} bytes",
                         None, "body_too_large")


class Guard:
    """The checks above around an ASGI `app`."""

    def __init__(self, app, api_key: str | None, hosts: frozenset[str] | None, origins: tuple[str, ...],
                 max_body_bytes: int, bodies: tuple[str, ...]):
        self.app = app
        self.bodies = bodies  # the routes that take a body (elsewhere a POST is the router's 405)
        self.api_key = api_key.encode() if api_key else None
        self.hosts, self.origins, self.max_body_bytes = hosts, origins, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        error = self.check(scope, headers)
        if error is not None:
            return await refuse(send, error)
        if scope["method"] == "POST" and scope["path"] in self.bodies:
            receive = self.capped(receive)
        return await self.app(scope, receive, send)

    def check(self, scope, headers: dict[str, str]) -> APIError | None:
        host = headers.get("host")
        if self.hosts is not None and host is not None and host_name(host) not in self.hosts:
            return APIError(403, f"Host {host!r} is not allowed (--allowed-hosts)", None, "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and origin not in self.origins and not same_origin(origin, host):
            return APIError(403, f"Origin {origin!r} is not allowed (--cors-origin)", None,
                            "origin_not_allowed")
        path = scope["path"]
        if self.api_key is not None and path not in OPEN and not path.startswith(OPEN_PREFIXES):
            scheme, _, key = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key):
                return APIError(401, "a valid API key is required: Authorization: Bearer KEY", None,
                                "invalid_api_key")
        if scope["method"] == "POST" and scope["path"] in self.bodies:
            kind = headers.get("content-type", "").partition(";")[0].strip().lower()
            if kind != "application/json":
                return APIError(415, f"the body must be JSON (Content-Type: application/json), got "
                                f"{kind or 'none'!r}", None, "unsupported_media_type")
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > self.max_body_bytes:
                return BodyTooLarge(self.max_body_bytes)
        return None

    def capped(self, receive):
        """`receive`, raising BodyTooLarge (answered by the app) once the body passes the bound."""
        seen = 0

        async def receive_capped():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        return receive_capped


async def refuse(send, error: APIError) -> None:
    body = json.dumps(error_body(error.message, error.type, error.param, error.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
