"""Operational behaviour of the server: one log line per refused request (4xx), a deadline on receiving request
bodies (408, slow or stalled senders), and request bodies declared in `/openapi.json`."""

from __future__ import annotations

import json
import logging
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dflash.server import ServerSettings, create_app
from dflash.server.header_deadline import header_deadline_protocol
from tests.server_helpers import FakeEngine, ServerThread, wait_until

pytestmark = pytest.mark.timeout(60)

ASK = [{"role": "user", "content": "hi"}]
BODY_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def server(fake: FakeEngine) -> Iterator[ServerThread]:
    """The app behind the protocol `dflash serve` runs (header deadline, lingering close)."""
    app = create_app(fake, ServerSettings(api_key="sekret", body_timeout_s=BODY_TIMEOUT_S))
    running = ServerThread(app, http=header_deadline_protocol(BODY_TIMEOUT_S)).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(autouse=True)
def fresh(fake: FakeEngine) -> None:
    fake.requests.clear()
    fake.token_delay = 0.0


AUTH = {"authorization": "Bearer sekret"}


# ------------------------------------------------------------------------------------------ 4xx log lines
def refusals(caplog: pytest.LogCaptureFixture, count: int) -> list[str]:
    """The server's log lines, once `count` have come (the line is written just after the answer is sent)."""

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "dflash.server" and r.levelno >= logging.INFO]

    wait_until(lambda: len(lines()) >= count, timeout=5)
    time.sleep(0.1)  # and no more than `count`
    return lines()


def test_each_4xx_is_logged_once_with_its_message(server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dflash.server")
    url = server.url
    httpx.post(f"{url}/v1/chat/completions", content=b"{nope", headers={**AUTH, "content-type": "application/json"})
    httpx.post(f"{url}/v1/messages", json={"model": "any", "messages": ASK, "max_tokens": 3})  # no key
    httpx.get(f"{url}/v1/nothing", headers=AUTH)
    httpx.post(f"{url}/v1/chat/completions", json={"model": "any", "messages": ASK, "max_tokens": 2}, headers=AUTH)
    lines = sorted(refusals(caplog, 3))
    assert len(lines) == 3, lines  # the 200 is not logged
    assert lines[0] == "GET /v1/nothing -> 404: no route GET /v1/nothing"
    assert lines[1].startswith("POST /v1/chat/completions -> 400: the request body is not valid JSON")
    assert lines[2] == ("POST /v1/messages -> 401: missing API key: send 'Authorization: Bearer <key>' or "
                        "'x-api-key: <key>'")


def test_log_lines_cannot_be_forged(server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dflash.server")
    httpx.get(f"{server.url}/v1/x%0AINFO%20forged%1b[31m", headers=AUTH)
    (line,) = refusals(caplog, 1)
    assert "\n" not in line and "\x1b" not in line and "\\x1b" in line


def test_long_messages_are_shortened(server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dflash.server")
    messages = [{"role": f"bad{i}", "content": 1} for i in range(30)]
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "any", "messages": messages}, headers=AUTH)
    assert response.status_code == 400
    (line,) = refusals(caplog, 1)
    assert line.endswith("...") and len(line) < 400


# ------------------------------------------------------------------------------------------ body deadline
def raw_exchange(server: ServerThread, path: str, parts: list[bytes], gap_s: float) -> tuple[bytes, float]:
    """Sends `parts` with `gap_s` between them (stopping once the server answers), then reads until the server
    closes the connection; returns what it answered and the seconds until its answer began.

    Between parts it waits for the answer itself (select) rather than sleeping: a part sent after the server
    answered and closed draws a reset, which can discard the unread answer on the client's side."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
                "Authorization: Bearer sekret\r\nContent-Length: 200\r\n\r\n").encode()
        sock.sendall(head)
        start = time.monotonic()
        answered_early = False
        for part in parts:
            if select.select([sock], [], [], 0)[0]:
                answered_early = True
                break
            try:
                sock.sendall(part)
            except OSError:  # closed by the server after its answer: read what it sent
                break
            if select.select([sock], [], [], gap_s)[0]:
                answered_early = True
                break
        answered = time.monotonic() - start
        received = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:  # the server closed the connection
                break
            if not received and not answered_early:
                answered = time.monotonic() - start
            received += chunk
    return received, answered


def split_answer(raw: bytes) -> tuple[str, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in header_lines)
    return status_line, headers, json.loads(body)


def test_a_stalled_body_is_408_and_the_connection_closed(server: ServerThread, fake: FakeEngine) -> None:
    raw, answered = raw_exchange(server, "/v1/chat/completions", [b'{"model": "any", "mess'], gap_s=0)
    status, headers, body = split_answer(raw)
    assert status.startswith("HTTP/1.1 408"), raw
    assert headers["connection"] == "close"
    assert body["error"]["code"] == "request_timeout" and "0.5 s" in body["error"]["message"]
    assert BODY_TIMEOUT_S - 0.05 <= answered < BODY_TIMEOUT_S + 3  # the server's clock may start a little earlier
    assert fake.requests == []


def test_a_dribbled_body_is_408_in_the_anthropic_format(server: ServerThread, fake: FakeEngine) -> None:
    # one byte every 50 ms keeps the connection busy, but the body would take 10 s
    raw, answered = raw_exchange(server, "/v1/messages", [b" "] * 200, gap_s=0.05)
    status, _, body = split_answer(raw)
    assert status.startswith("HTTP/1.1 408"), raw
    assert body["type"] == "error" and "not received within" in body["error"]["message"]
    assert answered < BODY_TIMEOUT_S + 3
    assert fake.requests == []


def test_a_stream_may_outlast_the_body_deadline(server: ServerThread, fake: FakeEngine) -> None:
    fake.token_delay = 0.05  # 27 characters: about 1.4 s, longer than the deadline
    body = {"model": "any", "messages": ASK, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=30) as response:
        text = "".join(response.iter_text())
    assert response.status_code == 200 and time.monotonic() - started > 2 * BODY_TIMEOUT_S
    assert "data: [DONE]" in text and '"finish_reason":"stop"' in text.replace(" ", "")


# ------------------------------------------------------------------------------------------ openapi
def test_openapi_declares_every_post_body(server: ServerThread) -> None:
    spec = httpx.get(f"{server.url}/openapi.json").json()
    components = spec["components"]["schemas"]
    posts = {path: item["post"] for path, item in spec["paths"].items() if "post" in item}
    assert set(posts) >= {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                          "/v1/messages/count_tokens"}

    def body_schema(path: str) -> dict[str, Any]:
        content = posts[path]["requestBody"]["content"]["application/json"]["schema"]
        return dict(components[content["$ref"].rsplit("/", 1)[-1]])

    for path in posts:
        assert body_schema(path)["type"] == "object", path
    assert "messages" in body_schema("/v1/chat/completions")["required"]
    assert "prompt" in body_schema("/v1/completions")["required"]
    assert set(body_schema("/v1/messages")["required"]) >= {"model", "messages", "max_tokens"}
    input_items = body_schema("/v1/responses")["properties"]["input"]["anyOf"][1]["items"]["anyOf"]
    assert {"#/components/schemas/MessageItem", "#/components/schemas/FunctionCallItem"} <= {i["$ref"] for i in input_items}
    for ref in json.dumps(spec).split('"$ref": "')[1:]:  # every reference resolves
        assert ref.split('"', 1)[0].rsplit("/", 1)[-1] in components


def test_bodies_are_still_parsed_by_the_routes(server: ServerThread) -> None:
    # a body the schema would reject is answered by the route's own checks, in the API's format
    response = httpx.post(f"{server.url}/v1/messages", json={"model": "any", "messages": ASK}, headers=AUTH)
    assert response.status_code == 400
    assert response.json()["type"] == "error" and "max_tokens" in response.json()["error"]["message"]
