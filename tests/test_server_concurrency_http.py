"""Concurrent serving over HTTP: requests generate side by side up to the engine's batch, a full queue is
refused in each API's own words (OpenAI 429, Anthropic 529 `overloaded_error`, both with Retry-After) and the
official SDKs come back after the delay and succeed, the per-request deadline ends a turn as "length", and
/metrics shows the pool."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import openai
import pytest

from dflash.generation.request import GenerationRequest, GenerationResult, TokenCallback
from dflash.server import ServerSettings, create_app
from tests.server_helpers import FakeEngine, metric, sdk_clients, serving, wait_until

pytestmark = pytest.mark.timeout(60)

CHAT = {"model": "any", "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class GatedEngine(FakeEngine):
    """`FakeEngine` whose generations wait for `gate` before their first token (deaf to `should_stop` until
    then), counting how many are inside at once; like the batching engine it reports each step's size to
    `step_observer`."""

    gate: threading.Event = field(default_factory=threading.Event)
    inside: int = 0
    peak: int = 0
    step_observer: Callable[[int], None] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def generate(
        self,
        request: GenerationRequest,
        *,
        on_text: TokenCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
        spec: str | None = None,
    ) -> GenerationResult:
        with self.lock:
            self.inside += 1
            self.peak = max(self.peak, self.inside)
        try:
            self.gate.wait(30)
            if self.step_observer is not None:
                self.step_observer(self.inside)
            return super().generate(request, on_text=on_text, should_stop=should_stop, spec=spec)
        finally:
            with self.lock:
                self.inside -= 1


@pytest.fixture
def gated() -> Iterator[GatedEngine]:
    engine = GatedEngine()
    yield engine
    engine.gate.set()  # never leave a worker thread waiting


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if isinstance(block, anthropic.types.TextBlock))


def occupy(url: str, path: str = "/v1/chat/completions", body: dict[str, Any] | None = None) -> tuple[threading.Thread, list[Any]]:
    return in_background(lambda: httpx.post(f"{url}{path}", json=body or CHAT, timeout=30))


def test_a_full_queue_is_refused_in_each_apis_words(gated: GatedEngine) -> None:
    with serving(create_app(gated, ServerSettings(max_concurrency=1, max_queue=0))) as running:
        oa, claude = sdk_clients(running)  # no retries: the refusal itself is seen
        blocker, answer = occupy(running.url)
        assert wait_until(lambda: gated.inside == 1)
        openai_calls: list[Callable[[], Any]] = [
            lambda: oa.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}]),
            lambda: oa.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}], stream=True),
            lambda: oa.completions.create(model="any", prompt="x"),
            lambda: oa.responses.create(model="any", input="x"),
        ]
        for call in openai_calls:
            with pytest.raises(openai.RateLimitError) as refused:
                call()
            assert refused.value.status_code == 429
            delay = refused.value.response.headers["retry-after"]
            assert 1 <= int(delay) <= 60  # whole seconds; 1 unless this machine is slow
            body = refused.value.body
            assert isinstance(body, dict)
            assert (body["type"], body["code"]) == ("server_error", "overloaded")
            assert body["message"] == f"the server is overloaded (generating 1, 0 waiting); retry after {delay} s"
        for stream in (False, True):
            with pytest.raises(anthropic.OverloadedError) as overloaded:
                claude.messages.create(model="any", max_tokens=16, messages=[{"role": "user", "content": "x"}],
                                       stream=stream)
            assert overloaded.value.status_code == 529
            delay = overloaded.value.response.headers["retry-after"]
            assert 1 <= int(delay) <= 60
            message = f"the server is overloaded (generating 1, 0 waiting); retry after {delay} s"
            assert overloaded.value.body == {"type": "error", "error": {"type": "overloaded_error", "message": message}}
        assert metric(running.url, "dflash_requests_total", api="chat", outcome="overloaded") == 2
        assert metric(running.url, "dflash_requests_total", api="messages", outcome="overloaded") == 2
        gated.gate.set()
        blocker.join(30)
        assert answer[0].status_code == 200
        assert gated.prompts == ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]  # nothing refused ran


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_the_official_sdks_retry_after_the_delay_and_get_in(gated: GatedEngine, sdk: str) -> None:
    with serving(create_app(gated, ServerSettings(max_concurrency=1, max_queue=0))) as running:
        blocker, _ = occupy(running.url)
        assert wait_until(lambda: gated.inside == 1)
        started = time.monotonic()
        if sdk == "openai":
            oa = openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=3, timeout=30)
            retried, answer = in_background(lambda: oa.chat.completions.create(
                model="any", messages=[{"role": "user", "content": "later"}]).choices[0].message.content)
            api = "chat"
        else:
            claude = anthropic.Anthropic(base_url=running.url, api_key="x", max_retries=3, timeout=30)
            retried, answer = in_background(lambda: text_of(claude.messages.create(
                model="any", max_tokens=64, messages=[{"role": "user", "content": "later"}])))
            api = "messages"
        assert wait_until(lambda: metric(running.url, "dflash_requests_total", api=api, outcome="overloaded") >= 1)
        gated.gate.set()
        retried.join(30)
        blocker.join(30)
    assert answer == ["Hello from the fake engine."]
    assert time.monotonic() - started >= 1.0  # it waited the Retry-After second before coming back
    assert "later" in gated.prompts[-1] and len(gated.prompts) == 2


def test_requests_generate_together_up_to_the_engines_batch(gated: GatedEngine) -> None:
    gated.options = SimpleNamespace(spec="none", max_batch=2)  # no --max-concurrency: the engine's batch rules
    with serving(create_app(gated, ServerSettings())) as running:
        url = running.url
        threads = [occupy(url)[0] for _ in range(3)]
        assert wait_until(lambda: gated.inside == 2 and metric(url, "dflash_requests_waiting") == 1)
        time.sleep(0.3)  # the third stays queued however long the first two take
        assert gated.inside == 2
        assert metric(url, "dflash_requests_running") == 2 and metric(url, "dflash_queue_depth") == 1
        assert metric(url, "dflash_busy") == 1
        gated.gate.set()
        for thread in threads:
            thread.join(30)
        assert wait_until(lambda: metric(url, "dflash_requests_total", api="chat", outcome="stop") == 3)
        assert metric(url, "dflash_requests_running") == 0 and metric(url, "dflash_requests_waiting") == 0
        assert metric(url, "dflash_batch_size_count") == 3  # one observed step per generation here
        assert 3 <= metric(url, "dflash_batch_size_sum") <= 6
        assert metric(url, "dflash_queue_wait_seconds_count") == 3
        assert metric(url, "dflash_queue_wait_seconds_sum") >= 0.3  # the third waited for a slot
    assert gated.peak == 2


def test_the_request_timeout_ends_a_running_turn_as_length() -> None:
    engine = FakeEngine(token_delay=0.01).script("a" * 3000, "b" * 3000, "c" * 3000)
    with serving(create_app(engine, ServerSettings(request_timeout_s=0.5, max_concurrency=2))) as running:
        oa, claude = sdk_clients(running)
        began = time.monotonic()
        chat = oa.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}])
        assert time.monotonic() - began < 10
        assert chat.choices[0].finish_reason == "length"
        text = chat.choices[0].message.content or ""
        assert 0 < len(text) < 3000 and set(text) == {"a"}  # the text so far
        message = claude.messages.create(model="any", max_tokens=4000, messages=[{"role": "user", "content": "x"}])
        assert message.stop_reason == "max_tokens" and 0 < len(text_of(message)) < 3000
        chunks = list(oa.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}], stream=True))
        assert chunks[-1].choices[0].finish_reason == "length"
        assert metric(running.url, "dflash_request_timeouts_total") == 3
        assert metric(running.url, "dflash_requests_total", api="chat", outcome="length") == 2
        assert metric(running.url, "dflash_requests_total", api="chat", outcome="cancelled") == 0


def test_a_request_whose_time_runs_out_in_the_queue_never_reaches_the_engine(gated: GatedEngine) -> None:
    settings = ServerSettings(request_timeout_s=0.3, max_concurrency=1)
    with serving(create_app(gated, settings)) as running:
        first, first_answer = occupy(running.url)
        assert wait_until(lambda: gated.inside == 1)
        second, second_answer = occupy(running.url, body={"model": "any", "messages": [{"role": "user", "content": "2"}]})
        assert wait_until(lambda: metric(running.url, "dflash_requests_waiting") == 1)
        time.sleep(0.5)  # both deadlines pass: the first while held at the gate, the second in the queue
        gated.gate.set()
        first.join(30)
        second.join(30)
    one, two = first_answer[0].json()["choices"][0], second_answer[0].json()["choices"][0]
    assert one["finish_reason"] == "length" and one["message"]["content"] == "H"  # stopped after its first token
    assert two["finish_reason"] == "length" and two["message"]["content"] == ""
    assert len(gated.prompts) == 1


def test_metrics_list_the_pool_series_before_any_request() -> None:
    with serving(create_app(FakeEngine(), ServerSettings())) as running:
        text = httpx.get(f"{running.url}/metrics", timeout=10).text
    for series in ("dflash_requests_running 0.0", "dflash_requests_waiting 0.0", "dflash_queue_depth 0.0",
                   "dflash_busy 0.0", "dflash_batch_size_count 0.0", "dflash_queue_wait_seconds_count 0.0",
                   "dflash_request_timeouts_total 0.0"):
        assert series in text

