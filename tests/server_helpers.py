"""Helpers of the server tests: a real uvicorn server on loopback in a thread, and a scripted fake engine.

`FakeEngine` has the `generate` signature of `dflash.engine.Engine` and pushes a scripted text through the
real `OutputSink` (so stop strings, max tokens, EOS and streaming hold-back behave as in the engine), one
character per token with a character-level tokenizer. It records every request it receives.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from dflash.errors import GenerationError
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest, GenerationResult, GenerationStats, TokenCallback

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A Hermes/Qwen-style template that renders tools natively, and a thinking variant.
HERMES = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% if message.tool_calls %}{% for c in message.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}{% endif %}"
)

# Qwen3-Coder style: tools rendered natively, calls written as <function=...><parameter=...>.
QWEN3_CODER = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}<function>{{ t.function.name }}</function>{% endfor %}"
    "Call tools as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

EOS = 0


class CharTokenizer:
    """One token per character; id 0 is EOS."""

    def __init__(self, chat_template: str | None = CHATML) -> None:
        self.chat_template = chat_template
        self.bos_token: str | None = None
        self.eos_token: str | None = "<|im_end|>"
        self.eos_token_ids = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if i != EOS)


Script = Callable[[str, GenerationRequest], str]


@dataclass
class FakeEngine:
    """Scripted stand-in for `Engine` (same `generate` contract)."""

    outputs: deque[str | Script] = field(default_factory=deque)  # consumed in order; then `default`
    default: str = "Hello from the fake engine."
    token_delay: float = 0.0
    fail_with: Exception | None = None  # raised after `fail_after` tokens
    fail_after: int = 0
    fail_once_stopped: bool = False  # raise only after should_stop() turned true
    max_ctx: int = 4096
    model_name: str = "fake-model"
    tokenizer: CharTokenizer = field(default_factory=CharTokenizer)
    options: Any = field(default_factory=lambda: SimpleNamespace(spec="none"))
    requests: list[GenerationRequest] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    stopped_early: list[bool] = field(default_factory=list)

    def script(self, *outputs: str | Script) -> FakeEngine:
        self.outputs.extend(outputs)
        return self

    def warm_up(self) -> int:
        return 0  # nothing to capture

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def generate(
        self,
        request: GenerationRequest,
        *,
        on_text: TokenCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
        spec: str | None = None,
    ) -> GenerationResult:
        if len(request.prompt_ids) + request.max_new_tokens > self.max_ctx:
            raise GenerationError(
                f"prompt ({len(request.prompt_ids)} tokens) + max tokens ({request.max_new_tokens}) exceeds "
                f"the context limit of {self.max_ctx} tokens"
            )
        prompt = self.tokenizer.decode(request.prompt_ids)
        self.requests.append(request)
        self.prompts.append(prompt)
        self.started.set()
        item = self.outputs.popleft() if self.outputs else self.default
        text = item(prompt, request) if callable(item) else item
        script = [*self.tokenizer.encode(text), EOS]
        sink = OutputSink(self.tokenizer.decode, eos_ids=(EOS,), max_new_tokens=request.max_new_tokens,
                          stop=request.stop, on_text=on_text)
        stats = GenerationStats(prompt_tokens=len(request.prompt_ids), rounds=0)
        stopped = False
        i = 0
        while not sink.finished:
            if self.fail_with is not None and not self.fail_once_stopped and i >= self.fail_after:
                raise self.fail_with
            token = script[min(i, len(script) - 1)]
            if token == EOS and len(sink.token_ids) < request.min_tokens:
                token = ord(".")  # EOS suppressed, as the engine's TokenChooser does
            i += 1
            if sink.push(token):
                break
            if should_stop is not None and should_stop():
                if self.fail_with is not None and self.fail_once_stopped:
                    raise self.fail_with
                stopped = True
                sink.finish_cancelled()
                break
            if self.token_delay:
                time.sleep(self.token_delay)
        self.stopped_early.append(stopped)
        stats.completion_tokens = len(sink.token_ids)
        stats.decode_s = 0.001 * max(1, len(sink.token_ids))
        assert sink.finish_reason is not None
        return GenerationResult(sink.text, sink.token_ids, sink.finish_reason, stats, sink.stop_reason)


class ServerThread:
    """uvicorn serving `app` on a free loopback port, in a background thread."""

    def __init__(self, app: Any, **config: Any) -> None:
        """`config`: further `uvicorn.Config` arguments (e.g. the `http` protocol class `dflash serve` uses)."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        options = {"log_level": "warning", "lifespan": "on", "timeout_graceful_shutdown": 3, **config}
        uvicorn_config = uvicorn.Config(app, **options)
        self.server = uvicorn.Server(uvicorn_config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


@contextmanager
def serving(app: Any) -> Iterator[ServerThread]:
    server = ServerThread(app).start()
    try:
        yield server
    finally:
        server.stop()


def sdk_clients(server: ServerThread, timeout: float = 60) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    """The official OpenAI and Anthropic clients pointed at a running test server (no retries)."""
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="dummy", max_retries=0, timeout=timeout)
    claude = anthropic.Anthropic(base_url=server.url, api_key="dummy", max_retries=0, timeout=timeout)
    return oa, claude


def metric(base_url: str, name: str, **labels: str) -> float:
    """Value of one sample of /metrics (0 when absent)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE event in a raw body (comments skipped)."""
    out = []
    for block in text.strip().split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data:
            out.append((name, "\n".join(data)))
    return out
