"""The surface of `dflash.engine.Engine` the server relies on, as a protocol (tests pass stand-ins)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from dflash.generation.request import GenerationRequest, GenerationResult, TokenCallback
from dflash.special_text import SpecialTextGuard


class TokenizerPort(Protocol):
    @property
    def chat_template(self) -> str | None: ...

    @property
    def bos_token(self) -> str | None: ...

    @property
    def eos_token(self) -> str | None: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class EnginePort(Protocol):
    @property
    def tokenizer(self) -> TokenizerPort: ...

    @property
    def max_ctx(self) -> int: ...

    @property
    def model_name(self) -> str: ...

    @property
    def options(self) -> Any: ...

    def encode(self, text: str, guard: SpecialTextGuard | None = None) -> list[int]: ...

    def generate(
        self,
        request: GenerationRequest,
        *,
        on_text: TokenCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
        spec: str | None = None,
    ) -> GenerationResult: ...


def spec_mode(engine: EnginePort, request: GenerationRequest) -> str:
    """The decoding strategy the engine uses for `request` ("none" for stand-ins that cannot say)."""
    chooser = getattr(engine, "spec_mode_for", None)
    if callable(chooser):
        return str(chooser(request, None))
    return str(getattr(engine.options, "spec", "none"))


def cached_prompt_tokens(engine: EnginePort, request: GenerationRequest) -> int:
    """Leading prompt tokens of `request` the engine's prefix cache holds now (0 for stand-ins without a cache).

    A forecast made before generation starts (the generation may find the cache changed by then)."""
    lookup = getattr(engine, "cached_prompt_tokens", None)
    if callable(lookup):
        return int(lookup(request))
    return 0
