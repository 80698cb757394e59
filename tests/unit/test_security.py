"""Who may talk to memrad: pure checks first, then the same through a served app."""

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from memrad.config import SecuritySettings, ServerSettings, Settings
from memrad.server.app import make_app
from memrad.server.context import CONTEXT
from memrad.server.openapi import ROUTES
from memrad.server.security import (AccessPolicy, bind_refusal, cors_headers, host_name, is_loopback,
                                    key_matches, refusal)

KEY = "sk-local-5f2e"
LOCAL = {"Host": "127.0.0.1:8765"}


def policy(**kw) -> AccessPolicy:
    return AccessPolicy.from_settings(SecuritySettings(**kw), "127.0.0.1")


def test_host_names_lose_their_port():
    assert host_name("127.0.0.1:8765") == "127.0.0.1"
    assert host_name("LOCALHOST") == "localhost"
    assert host_name("[::1]:80") == "[::1]"
    assert host_name("evil.example:8765") == "evil.example"
    assert host_name("[::1]") == "[::1]" and host_name("localhost:1") == "localhost"


@pytest.mark.parametrize("bad", ["127.0.0.1:abc", "127.0.0.1:", "127.0.0.1:99999", "127.0.0.1:+80",
                                 "[::1]evil", "[::1]:80x", "[::1", "localhost:80:80", "127.0.0.1 :80", ""])
def test_a_malformed_host_is_no_name_and_is_refused(bad):
    assert host_name(bad) is None
    refused = refusal("GET", "/v1/models", {"Host": bad}, policy())
    assert refused is not None and (refused.status, refused.code) == (403, "host_not_allowed")


def test_loopback_means_this_machine_only():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.4.5", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "192.168.1.20", "::", "memra.lan"))


def test_dns_rebinding_host_is_refused_with_403_naming_the_setting():
    err = refusal("POST", "/v1/chat/completions", {"Host": "evil.example:8765"}, policy())
    assert err.status == 403 and err.code == "host_not_allowed"
    assert "'evil.example:8765'" in err.message and "security.allowed_hosts" in err.message
    assert refusal("GET", "/health", {"Host": "evil.example"}, policy()).status == 403  # /health too
    assert refusal("GET", "/health", {"Host": "memra.lan"}, policy(allowed_hosts="memra.lan")) is None


def test_cross_origin_requests_are_refused_unless_configured_or_same_origin():
    page = {**LOCAL, "Origin": "https://evil.example"}
    err = refusal("POST", "/v1/chat/completions", page, policy())
    assert err.status == 403 and err.code == "origin_not_allowed"
    assert refusal("POST", "/v1/chat/completions", {**LOCAL, "Origin": "null"}, policy()).status == 403
    assert refusal("POST", "/v1/chat/completions", {**LOCAL, "Origin": "http://127.0.0.1:8765"}, policy()) is None
    mine = policy(allowed_origins="http://localhost:3000/")
    assert refusal("POST", "/v1/models", {**LOCAL, "Origin": "http://localhost:3000"}, mine) is None
    assert refusal("POST", "/v1/models", {**LOCAL, "Origin": "http://localhost:3001"}, mine).status == 403


def test_cors_headers_only_for_configured_origins():
    assert cors_headers("http://localhost:3000", policy()) == {}
    headers = cors_headers("http://localhost:3000", policy(allowed_origins="http://localhost:3000"))
    assert headers["Access-Control-Allow-Origin"] == "http://localhost:3000" and headers["Vary"] == "Origin"
    assert cors_headers("http://other:1", policy(allowed_origins="http://localhost:3000")) == {}


@pytest.mark.parametrize("headers, ok", [
    ({"Authorization": f"Bearer {KEY}"}, True),
    ({"Authorization": f"bearer  {KEY} "}, True),
    ({"x-api-key": KEY}, True),
    ({"Authorization": f"Basic {KEY}"}, False),
    ({"Authorization": "Bearer sk-local-5f2f"}, False),
    ({"x-api-key": KEY[:-1]}, False),
    ({}, False),
])
def test_the_key_is_bearer_or_x_api_key(headers, ok):
    err = refusal("GET", "/v1/models", {**LOCAL, **headers}, policy(api_key=KEY))
    assert (err is None) == ok
    if not ok:
        assert err.status == 401 and err.code == "invalid_api_key" and err.headers == {"WWW-Authenticate": "Bearer"}
        sent = "x-api-key" in headers or headers.get("Authorization", "").lower().startswith("bearer")
        assert ("no API key was sent" in err.message) != sent


def test_health_stays_open_and_no_key_means_no_check():
    assert refusal("GET", "/health", LOCAL, policy(api_key=KEY)) is None
    assert refusal("GET", "/v1/models", LOCAL, policy()) is None
    assert key_matches(KEY, KEY) and not key_matches(None, KEY) and not key_matches("", KEY)


def test_a_non_loopback_bind_needs_a_key_or_the_loud_override(caplog):
    assert bind_refusal(SecuritySettings(), "127.0.0.1") is None
    why = bind_refusal(SecuritySettings(), "0.0.0.0")
    assert why.startswith("refusing to listen on 0.0.0.0 without an API key") and "--api-key" in why
    assert bind_refusal(SecuritySettings(api_key=KEY), "0.0.0.0") is None
    assert bind_refusal(SecuritySettings(allow_remote_without_key=True), "0.0.0.0") is None
    assert "SECURITY: listening on 0.0.0.0 WITHOUT an API key" in caplog.text


# --- through the app -----------------------------------------------------------------------

async def served(engine, **security):
    settings = Settings(server=ServerSettings(shutdown_grace_s=1.0), security=SecuritySettings(**security))
    server = TestServer(make_app(settings, engine, "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    return server


def request_for(route) -> dict:
    return {"json": route.example} if route.example is not None else {}


async def test_the_key_guards_every_api_route_and_health_stays_open(fake_engine):
    server = await served(fake_engine, api_key=KEY)
    try:
        async with aiohttp.ClientSession() as session:
            for route in ROUTES:
                url = server.make_url(route.path)
                async with session.request(route.method, url, **request_for(route)) as resp:
                    if route.path == "/health":
                        assert resp.status == 200
                        continue
                    assert resp.status == 401, route.path
                    body = await resp.json()
                    assert body["error"]["type"] == "authentication_error"
                    if route.path.startswith("/v1/messages"):  # Anthropic's envelope
                        assert body["type"] == "error" and "no API key was sent" in body["error"]["message"]
                    else:
                        assert body["error"]["code"] == "invalid_api_key"
                async with session.request(route.method, url, headers={"x-api-key": "wrong"},
                                           **request_for(route)) as resp:
                    assert resp.status == 401, route.path
                async with session.request(route.method, url, headers={"Authorization": f"Bearer {KEY}"},
                                           **request_for(route)) as resp:
                    assert resp.status == 200, (route.path, await resp.text())
    finally:
        await server.close()


async def test_rebinding_and_a_text_plain_cross_origin_post_never_reach_the_model(fake_engine):
    server = await served(fake_engine)
    url = server.make_url("/v1/chat/completions")
    body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, data=body, headers={"Host": "evil.example:8765"}) as resp:
                assert resp.status == 403 and (await resp.json())["error"]["code"] == "host_not_allowed"
            # What a page may send without a CORS preflight: a "simple" text/plain POST.
            async with session.post(url, data=body, headers={"Content-Type": "text/plain",
                                                             "Origin": "https://evil.example"}) as resp:
                assert resp.status == 403 and (await resp.json())["error"]["code"] == "origin_not_allowed"
                assert "Access-Control-Allow-Origin" not in resp.headers
            async with session.options(url, headers={"Origin": "https://evil.example",
                                                     "Access-Control-Request-Method": "POST"}) as resp:
                assert resp.status == 403 and "Access-Control-Allow-Origin" not in resp.headers
            for route in ROUTES:  # every route of every API, each in its API's error shape
                for headers in ({"Host": "evil.example"}, {"Origin": "https://evil.example"}):
                    async with session.request(route.method, server.make_url(route.path), headers=headers,
                                               **request_for(route)) as resp:
                        assert resp.status == 403, (route.path, headers)
                        refused = await resp.json()
                        assert refused["error"]["type"] == "permission_error"
                        assert (refused.get("type") == "error") == route.path.startswith("/v1/messages")
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
        assert server.app[CONTEXT].scheduler.requests_served == 1  # only the last one ran
    finally:
        await server.close()


async def test_a_configured_origin_gets_cors_on_preflight_and_on_streams(fake_engine):
    origin = "http://localhost:3000"
    server = await served(fake_engine, allowed_origins=origin)
    url = server.make_url("/v1/chat/completions")
    try:
        async with aiohttp.ClientSession() as session:
            async with session.options(url, headers={"Origin": origin, "Access-Control-Request-Method": "POST"}) as r:
                assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == origin
                assert "Authorization" in r.headers["Access-Control-Allow-Headers"]
            async with session.post(url, headers={"Origin": origin}, json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}) as r:
                assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == origin
                assert (await r.text()).endswith("data: [DONE]\n\n")
    finally:
        await server.close()


def test_memrad_start_refuses_a_non_loopback_host_without_a_key(capsys, monkeypatch, tmp_path):
    from memrad import cli

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    for name in ("MEMRA_API_KEY", "MEMRA_HOST", "MEMRA_ALLOW_REMOTE_WITHOUT_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["start", "--host", "0.0.0.0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("memrad: refusing to listen on 0.0.0.0 without an API key")
    monkeypatch.setenv("MEMRA_HOST", "192.168.7.7")
    assert cli.main(["start"]) == 1 and "refusing to listen on 192.168.7.7" in capsys.readouterr().err


def raw_get(port: int, path: str, header: bytes) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + header +
                     b"\r\nConnection: close\r\n\r\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("header", [b"x-api-key: \xff\xfe" + KEY.encode(), b"Authorization: Bearer \xc3(" + KEY.encode(),
                                    b"Authorization: \xff", b"x-api-key: " + KEY.encode() + b"\x80"])
async def test_a_key_that_is_not_utf8_is_a_401_not_a_500(fake_engine, header):
    import asyncio

    server = await served(fake_engine, api_key=KEY)
    try:
        for path in ("/v1/models", "/v1/messages/count_tokens"):
            answer = await asyncio.to_thread(raw_get, server.port, path, header)
            assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    finally:
        await server.close()


def test_keys_are_compared_as_bytes():
    assert key_matches(KEY.encode() , KEY) and not key_matches(b"\xff" + KEY.encode(), KEY)
    assert key_matches("ключ".encode(), "ключ") and not key_matches(None, KEY)
