"""Server settings: one frozen record built by `dflash serve` (or a test) and read everywhere else."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash.server.stall import StallSettings

DEFAULT_MAX_TOKENS_CAP = 4096  # completion budget when a request names none (also capped by the context)
DEFAULT_BODY_LIMIT = 8 * 1024 * 1024
DEFAULT_MAX_QUEUE = 64  # requests waiting beyond the running ones before new ones get 429/529


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the engine's model name
    api_key: str | None = None  # None: no authentication
    allowed_hosts: tuple[str, ...] | None = None  # Host names accepted besides loopback (origin_guard); "*": any
    allowed_origins: tuple[str, ...] = ()  # web origins whose pages may call the API (CORS); "*": any
    body_timeout_s: float = 60.0  # time to receive a whole request body, then 408 (slow or stalled senders)
    http_keep_alive_s: float = 30.0  # an idle connection is closed after this (not the SSE keepalive below)
    default_max_tokens: int | None = None  # None: DEFAULT_MAX_TOKENS_CAP, capped by the remaining context
    clamp_max_tokens: bool = False  # cap a too-large max tokens to the room left in the context, instead of a 400
    remap_developer_role: bool = False  # render OpenAI "developer" messages as "system"
    chat_template: str | None = None  # overrides the tokenizer's chat template
    max_body_bytes: int = DEFAULT_BODY_LIMIT
    keepalive_s: float = 15.0  # SSE comment sent while a streamed request waits without output
    stall: StallSettings = field(default_factory=StallSettings)
    max_concurrency: int | None = None  # requests generating at once; None: the engine's max_batch (else 1)
    max_queue: int | None = DEFAULT_MAX_QUEUE  # requests waiting beyond those; None: unbounded
    request_timeout_s: float | None = None  # arrival to a forced end of the turn (finish reason "length")

    def completion_cap(self) -> int:
        return self.default_max_tokens or DEFAULT_MAX_TOKENS_CAP

    def concurrency_for(self, engine_options: object) -> int:
        """Requests to run at once: `max_concurrency`, else as many as the engine batches (1 if it cannot say)."""
        if self.max_concurrency is not None:
            return self.max_concurrency
        return max(1, int(getattr(engine_options, "max_batch", None) or 1))
