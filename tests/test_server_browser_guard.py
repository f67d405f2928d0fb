"""A web page cannot use the keyless local server: non-JSON bodies (CORS "simple" requests) are 415, foreign
`Host` headers (DNS rebinding) and foreign `Origin` headers are 403, in the called API's own error format, and
the engine never runs for them. Flags widen what is accepted; CORS preflights are answered for allowed origins."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dflash.server import ServerSettings, create_app
from dflash.server.origin_guard import BrowserPolicy, split_host
from tests.server_helpers import FakeEngine, ServerThread, sdk_clients, serving

pytestmark = pytest.mark.timeout(60)

CHAT = {"model": "any", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
JSON_TEXT = '{"model": "any", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}'


@pytest.fixture(scope="module")
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def server(fake: FakeEngine) -> Iterator[ServerThread]:
    with serving(create_app(fake, ServerSettings())) as running:
        yield running


@pytest.fixture(autouse=True)
def no_requests_yet(fake: FakeEngine) -> None:
    fake.requests.clear()


def post(url: str, path: str, headers: dict[str, str], content: str = JSON_TEXT) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=content.encode(), headers=headers, timeout=30)


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return dict(response.json()["error"])


def anthropic_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error"
    return dict(body["error"])


# ------------------------------------------------------------------------------------------ content type
@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_not_declared_json_is_415(server: ServerThread, fake: FakeEngine, content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type else {}
    error = openai_error(post(server.url, "/v1/chat/completions", headers), 415)
    assert "Content-Type: application/json" in error["message"] and error["code"] == "unsupported_media_type"
    error = anthropic_error(post(server.url, "/v1/messages", headers), 415)
    assert error["type"] == "invalid_request_error" and "must be JSON" in error["message"]
    assert fake.requests == []  # nothing was generated


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8", "application/vnd.dflash+json"])
def test_json_media_types_are_accepted(server: ServerThread, fake: FakeEngine, content_type: str) -> None:
    response = post(server.url, "/v1/chat/completions", {"content-type": content_type})
    assert response.status_code == 200, response.text
    assert len(fake.requests) == 1


# ------------------------------------------------------------------------------------------ host
@pytest.mark.parametrize("host", ["evil.example:8000", "evil.example", "192.168.1.7:8000", "localhost.evil.example"])
def test_a_foreign_host_is_refused(server: ServerThread, fake: FakeEngine, host: str) -> None:
    headers = {"host": host, "content-type": "application/json"}
    error = openai_error(post(server.url, "/v1/chat/completions", headers), 403)
    assert error["code"] == "host_not_allowed" and "--allowed-hosts" in error["message"]
    assert anthropic_error(post(server.url, "/v1/messages", headers), 403)["type"] == "permission_error"
    # a rebound page cannot read anything either
    assert httpx.get(f"{server.url}/v1/models", headers={"host": host}).status_code == 403
    assert httpx.get(f"{server.url}/metrics", headers={"host": host}).status_code == 403
    assert fake.requests == []


@pytest.mark.parametrize("host", ["localhost:8000", "LOCALHOST", "127.0.0.1", "127.0.0.1:9", "[::1]:8000", "[::1]",
                                  "localhost."])
def test_loopback_names_are_accepted_with_any_port(server: ServerThread, host: str) -> None:
    response = post(server.url, "/v1/chat/completions", {"host": host, "content-type": "application/json"})
    assert response.status_code == 200, response.text


def test_health_stays_open(server: ServerThread) -> None:
    response = httpx.get(f"{server.url}/health", headers={"host": "evil.example", "origin": "https://evil.example"})
    assert response.status_code == 200


def test_allowed_hosts_flag() -> None:
    with serving(create_app(FakeEngine(), ServerSettings(allowed_hosts=("dflash.lan",)))) as running:
        headers = {"content-type": "application/json"}
        assert post(running.url, "/v1/chat/completions", {**headers, "host": "dflash.lan:8000"}).status_code == 200
        assert post(running.url, "/v1/chat/completions", {**headers, "host": "localhost:8000"}).status_code == 200
        assert post(running.url, "/v1/chat/completions", {**headers, "host": "evil.example"}).status_code == 403
    with serving(create_app(FakeEngine(), ServerSettings(allowed_hosts=("*",)))) as running:
        assert post(running.url, "/v1/chat/completions", {**headers, "host": "evil.example"}).status_code == 200


def test_host_policy_follows_the_listening_address() -> None:
    local = BrowserPolicy.for_server("127.0.0.1", None, ())
    assert local.host_allowed("localhost:1") and local.host_allowed("[::1]:80")
    assert not local.host_allowed("evil.example:8000") and not local.host_allowed("10.0.0.5:8000")
    # exposed on every interface: the names it is reached by are unknown, any is accepted unless the flag is given
    exposed = BrowserPolicy.for_server("0.0.0.0", None, ())
    assert exposed.host_allowed("10.0.0.5:8000") and exposed.host_allowed("gpu-box.lan")
    narrowed = BrowserPolicy.for_server("0.0.0.0", ("gpu-box.lan",), ())
    assert narrowed.host_allowed("gpu-box.lan:8000") and narrowed.host_allowed("127.0.0.1:8000")
    assert not narrowed.host_allowed("evil.example") and not narrowed.host_allowed("0.0.0.0:8000")
    # a specific address is accepted as itself once hosts are narrowed
    assert BrowserPolicy.for_server("10.0.0.5", ("box",), ()).host_allowed("10.0.0.5:8000")
    assert BrowserPolicy.for_server("::1", None, ()).hosts is not None  # IPv6 loopback is loopback


def test_host_header_forms() -> None:
    assert split_host("[::1]:8000") == ("::1", 8000)
    assert split_host("Example.COM.") == ("example.com", None)
    assert split_host("host:80") == ("host", 80)
    assert split_host("::1") == ("::1", None)


# ------------------------------------------------------------------------------------------ origin
@pytest.mark.parametrize("origin", ["https://evil.example", "http://localhost:3000", "null", "http://127.0.0.1"])
def test_a_foreign_origin_is_refused(server: ServerThread, fake: FakeEngine, origin: str) -> None:
    headers = {"origin": origin, "content-type": "application/json"}
    error = openai_error(post(server.url, "/v1/chat/completions", headers), 403)
    assert error["code"] == "origin_not_allowed" and "--allowed-origins" in error["message"]
    assert anthropic_error(post(server.url, "/v1/messages", headers), 403)["type"] == "permission_error"
    assert fake.requests == []


def test_same_origin_pages_are_served(server: ServerThread) -> None:
    own = f"http://127.0.0.1:{server.port}"
    assert post(server.url, "/v1/chat/completions", {"origin": own, "content-type": "application/json"}).status_code == 200
    via_localhost = {"origin": f"http://localhost:{server.port}", "host": f"localhost:{server.port}",
                     "content-type": "application/json"}
    assert post(server.url, "/v1/chat/completions", via_localhost).status_code == 200


def test_preflight_is_refused_without_allowed_origins(server: ServerThread) -> None:
    response = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "origin": "https://evil.example", "access-control-request-method": "POST",
        "access-control-request-headers": "content-type"})
    assert response.status_code == 403
    assert "access-control-allow-origin" not in response.headers


def test_allowed_origins_get_cors_answers() -> None:
    page = "http://localhost:3000"
    settings = ServerSettings(allowed_origins=(page,), api_key="sekret")
    fake = FakeEngine()
    with serving(create_app(fake, settings)) as running:
        url = f"{running.url}/v1/chat/completions"
        preflight = httpx.options(url, headers={
            "origin": page, "access-control-request-method": "POST",
            "access-control-request-headers": "content-type, authorization"})
        assert preflight.status_code == 200, preflight.text  # answered before the key check: preflights carry none
        assert preflight.headers["access-control-allow-origin"] == page
        assert "POST" in preflight.headers["access-control-allow-methods"]
        headers = {"origin": page, "content-type": "application/json", "authorization": "Bearer sekret"}
        response = post(running.url, "/v1/chat/completions", headers)
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == page
        evil = {**headers, "origin": "https://evil.example"}
        assert post(running.url, "/v1/chat/completions", evil).status_code == 403
        assert len(fake.requests) == 1


# ------------------------------------------------------------------------------------------ clients
def test_sdk_clients_and_streams_pass(server: ServerThread) -> None:
    oa, claude = sdk_clients(server)
    assert oa.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    chunks = list(oa.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello from the fake engine."
    with claude.messages.stream(model="any", max_tokens=50, messages=[{"role": "user", "content": "hi"}]) as stream:
        assert "".join(stream.text_stream) == "Hello from the fake engine."
