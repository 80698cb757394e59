"""Who may talk to the API: the optional key, the Host allowlist, the Origin check.

The adversaries are a web page in the user's browser (it can send requests to 127.0.0.1,
and with DNS rebinding make them look same-origin to the browser) and other users of the
machine or network. So:

  - Host must be a loopback name, the bound address or a configured host: a rebinding
    page's requests carry its own name (`Host: evil.example`) and are refused (403).
  - A request carrying `Origin` (browsers send it on cross-origin requests and on every
    POST) is refused (403) unless the origin is configured or is the server itself. That
    covers the CORS "simple request" a page may send without preflight (a text/plain POST).
    CORS headers go only to configured origins.
  - With an API key, every route but /health needs it (Bearer or x-api-key), compared in
    constant time; a missing or wrong key gets 401.

The checks are pure functions of (method, path, headers); `guard` is the aiohttp middleware.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from memrad.config import SecuritySettings
from memrad.server.errors import APIError, shown

log = logging.getLogger("memrad.security")

OPEN_PATHS = frozenset({"/health"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
CORS_ALLOW_HEADERS = "Authorization, Content-Type, x-api-key, x-session-id, anthropic-version"
CORS_ALLOW_METHODS = "GET, POST, OPTIONS"


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    """The settings in force, normalized: lowercase names, origins without a trailing slash."""

    api_key: str | None
    hosts: frozenset[str]
    origins: frozenset[str]

    @classmethod
    def from_settings(cls, security: SecuritySettings, bound_host: str) -> "AccessPolicy":
        extra = {h.strip().lower() for h in security.allowed_hosts.split(",") if h.strip()}
        origins = {o.strip().lower().rstrip("/") for o in security.allowed_origins.split(",") if o.strip()}
        bound = {bound_host.lower()} if bound_host not in ("", "0.0.0.0", "::") else set()
        return cls(api_key=security.api_key or None, hosts=frozenset(LOOPBACK_NAMES | bound | extra),
                   origins=frozenset(origins))


def is_loopback(host: str) -> bool:
    """True for names and addresses that only this machine can reach."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_refusal(security: SecuritySettings, host: str) -> str | None:
    """Why the daemon must not start on `host` (None: it may). The override only warns."""
    if is_loopback(host) or security.api_key:
        return None
    if security.allow_remote_without_key:
        log.warning("SECURITY: listening on %s WITHOUT an API key (allow_remote_without_key): anyone "
                    "who can reach this address can use the model", host)
        return None
    return (f"refusing to listen on {host} without an API key: anyone on the network could use the "
            "model. Set one with --api-key or MEMRA_API_KEY, bind to 127.0.0.1, or (not recommended) "
            "pass --allow-remote-without-key")


HOST_PORT = re.compile(r"(?P<name>\[[0-9a-f:.]+\]|[^\[\]:\s]+)(?::(?P<port>[0-9]{1,5}))?")


def host_name(host_header: str) -> str | None:
    """`Host` without its port: "127.0.0.1:8765" -> "127.0.0.1", "[::1]:80" -> "[::1]". None
    for anything malformed: a port that is not a number in 1..65535 (`127.0.0.1:abc`),
    text after an IPv6 literal's bracket (`[::1]evil`), an empty name."""
    match = HOST_PORT.fullmatch(host_header.strip().lower())
    if match is None:
        return None
    port = match.group("port")
    if port is not None and not 0 < int(port) <= 65535:
        return None
    return match.group("name")


def origin_allowed(origin: str, host_header: str, policy: AccessPolicy) -> bool:
    """A configured origin, or the server's own (same scheme-less host:port as `Host`)."""
    origin = origin.strip().lower().rstrip("/")
    if "*" in policy.origins or origin in policy.origins:
        return True
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc == host_header.strip().lower()


def presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key") or None


def as_bytes(value: str | bytes | None) -> bytes:
    """A header value's bytes as they came. aiohttp decodes headers as UTF-8 with
    surrogateescape, so a non-UTF-8 byte comes back as itself, never as an encode error."""
    if isinstance(value, bytes):
        return value
    return (value or "").encode("utf-8", "surrogateescape")


def key_matches(presented: str | bytes | None, expected: str) -> bool:
    """Compared as bytes, in constant time in the key's content (hmac.compare_digest),
    whatever was presented (a malformed key is just a wrong one: 401)."""
    return hmac.compare_digest(as_bytes(presented), expected.encode("utf-8"))


def refusal(method: str, path: str, headers: Mapping[str, str], policy: AccessPolicy) -> APIError | None:
    """The error that refuses this request, or None when it may proceed. Pure."""
    host = headers.get("Host", "")
    if host_name(host) not in policy.hosts:
        return APIError(403, f"the Host header {shown(host)} is not allowed: memrad answers only to "
                        f"{', '.join(sorted(policy.hosts))} (a web page using DNS rebinding sends its own "
                        "name). Add the name to security.allowed_hosts (MEMRA_ALLOWED_HOSTS) if it is yours",
                        type="permission_error", code="host_not_allowed")
    origin = headers.get("Origin")
    if origin is not None and not origin_allowed(origin, host, policy):
        return APIError(403, f"requests from the browser origin {shown(origin)} are refused: a web page may not "
                        "drive the local model. Add the origin to security.allowed_origins "
                        "(MEMRA_ALLOWED_ORIGINS) if it is yours", type="permission_error",
                        code="origin_not_allowed")
    if policy.api_key is None or path in OPEN_PATHS or method == "OPTIONS":
        return None
    presented = presented_key(headers)
    if not key_matches(presented, policy.api_key):
        said = "no API key was sent" if presented is None else "the API key is wrong"
        return APIError(401, f"{said}: send `Authorization: Bearer <key>` or `x-api-key: <key>` with the key "
                        "memrad was started with (--api-key / MEMRA_API_KEY)", type="authentication_error",
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return None


def cors_headers(origin: str | None, policy: AccessPolicy) -> dict[str, str]:
    """CORS headers for a configured origin only; none otherwise (the browser then blocks reads)."""
    if origin is None or not policy.origins:
        return {}
    normal = origin.strip().lower().rstrip("/")
    if normal not in policy.origins and "*" not in policy.origins:
        return {}
    return {"Access-Control-Allow-Origin": origin, "Vary": "Origin",
            "Access-Control-Allow-Headers": CORS_ALLOW_HEADERS, "Access-Control-Allow-Methods": CORS_ALLOW_METHODS,
            "Access-Control-Max-Age": "600"}


POLICY = web.AppKey("access_policy", AccessPolicy)


@web.middleware
async def guard(request: web.Request, handler) -> web.StreamResponse:
    """Refuse before any handler runs; answer CORS preflights of configured origins."""
    policy = request.app[POLICY]
    refused = refusal(request.method, request.path, request.headers, policy)
    if refused is not None:
        raise refused
    if request.method == "OPTIONS":
        cors = cors_headers(request.headers.get("Origin"), policy)
        if cors:
            return web.Response(status=204)
    return await handler(request)


async def add_cors(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: runs before the headers leave, for streamed responses too."""
    response.headers.update(cors_headers(request.headers.get("Origin"), request.app[POLICY]))


def install(app: web.Application, security: SecuritySettings, bound_host: str) -> None:
    app[POLICY] = AccessPolicy.from_settings(security, bound_host)
    app.on_response_prepare.append(add_cors)
