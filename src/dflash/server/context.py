"""Per-app state shared by the routes: engine, settings, prompt builder, runner, metrics; plus the checks
every API applies the same way (model name, token budget, sampling parameters)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from dflash.errors import GenerationError
from dflash.generation.constraints import TokenConstraint
from dflash.generation.request import GenerationRequest
from dflash.generation.sampling import SamplingParams
from dflash.server.context_limit import API, output_does_not_fit, prompt_too_long
from dflash.server.conversation import Message, ToolChoice, ToolSpec
from dflash.server.engine_port import EnginePort
from dflash.server.errors import APIError
from dflash.server.metrics import Metrics
from dflash.server.prompt import Prompt, PromptBuilder
from dflash.server.response_format import AnswerSchema, answer_constraint
from dflash.server.runner import TurnRunner
from dflash.server.settings import ServerSettings
from dflash.server.tool_constraint import tool_constraint
from dflash.server.turn import Turn
from dflash.server.worker import GenerationWorker

ANY_MODEL = frozenset({"", "any"})
_PROMPT_PARAM: dict[API, str] = {"chat": "messages", "completions": "prompt", "responses": "input", "anthropic": "messages"}


@dataclass
class ServerContext:
    engine: EnginePort
    settings: ServerSettings
    prompts: PromptBuilder
    worker: GenerationWorker
    runner: TurnRunner
    metrics: Metrics
    model_name: str
    created: int

    # ---- names ------------------------------------------------------------------------------------
    def resolve_model(self, requested: str | None) -> str:
        if requested is None or requested.strip() in ANY_MODEL or requested in (self.model_name, self.engine.model_name):
            return self.model_name
        raise APIError(
            404, f"model {requested!r} does not exist; this server serves {self.model_name!r} (or use \"any\")",
            kind="not_found", param="model", code="model_not_found",
        )

    # ---- budgets ----------------------------------------------------------------------------------
    def max_new_tokens(self, requested: int | None, prompt_tokens: int, *, api: API, param: str) -> int:
        """The output budget of a request: `requested` (`param` in the API), or, when the client names none, the
        server's default cap within the room the context leaves. A prompt or budget that does not fit is refused
        in the API's own words (`dflash.server.context_limit`), or clamped with `--clamp-max-tokens`."""
        limit = self.engine.max_ctx
        prompt_param = _PROMPT_PARAM[api]
        if prompt_tokens >= limit:
            raise prompt_too_long(api, prompt_tokens, limit, prompt_param=prompt_param)
        room = limit - prompt_tokens
        if requested is None:
            return min(self.settings.completion_cap(), room)
        if requested > room:
            if self.settings.clamp_max_tokens:
                return room
            raise output_does_not_fit(
                api, prompt_tokens, requested, limit, prompt_param=prompt_param, output_param=param
            )
        return requested

    def min_tokens(self, tools_offered: bool, max_new_tokens: int) -> int:
        if not tools_offered:
            return 0
        return min(self.settings.stall.min_tokens, max_new_tokens)

    # ---- prompts ----------------------------------------------------------------------------------
    async def build_prompt(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec],
        choice: ToolChoice,
        template_kwargs: Mapping[str, Any] | None,
    ) -> Prompt:
        return await run_in_threadpool(self.prompts.build, messages, tools, choice, template_kwargs)

    def turn_constraint(
        self, prompt: Prompt, choice: ToolChoice, answer: AnswerSchema | None = None
    ) -> TokenConstraint | None:
        """Only offered tool names (and strict tools' schemas) after a forced call opening; else a JSON answer
        when the request asks for one (`answer`: its schema and the parameter that gave it). None for an engine
        that builds no constraints (test stand-ins)."""
        source = getattr(self.engine, "constraints", None)
        if source is None:
            return None
        if prompt.forced_prefix:
            return tool_constraint(source, prompt.tools, choice, prompt.tool_format)
        if answer is None or prompt.starts_in_reasoning:
            return None
        return answer_constraint(source, answer.schema, calls_allowed=bool(prompt.tools), param=answer.param)

    async def chat_turn(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int,
        sampling: SamplingParams,
        stop: Sequence[str],
        choice: ToolChoice,
        received_at: float,
        use_prefix_cache: bool = True,
        answer: AnswerSchema | None = None,
    ) -> Turn:
        """The turn of a chat request. Its constraint is built off the event loop: a tokenizer's first one builds
        the vocabulary's byte table, and strict schemas compile to grammars."""
        constraint = await run_in_threadpool(self.turn_constraint, prompt, choice, answer)
        offered = prompt.tools
        stall_tool = None
        if offered:
            if choice.mode == "named":
                stall_tool = choice.name
            elif len(offered) == 1:
                stall_tool = offered[0].name
        return Turn(
            request=GenerationRequest(
                prompt_ids=prompt.ids, max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop),
                min_tokens=self.min_tokens(bool(offered), max_new_tokens), use_prefix_cache=use_prefix_cache,
                constraint=constraint,
            ),
            tools=offered,
            tool_format=prompt.tool_format,
            forced_prefix=prompt.forced_prefix,
            starts_in_reasoning=prompt.starts_in_reasoning,
            stall_tool=stall_tool,
            received_at=received_at,
        )


def sampling_params(
    *,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
) -> SamplingParams:
    """Unset values take the engine's defaults (greedy decoding when no temperature is given)."""
    try:
        return SamplingParams(
            temperature=0.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=top_k or 0,
            min_p=min_p or 0.0,
            seed=seed,
            presence_penalty=presence_penalty or 0.0,
            frequency_penalty=frequency_penalty or 0.0,
        )
    except GenerationError as exc:
        raise APIError(400, str(exc)) from None


def stop_list(stop: str | list[str] | None, *, param: str = "stop") -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else list(stop)
    if any(not s for s in items):
        raise APIError(400, f"{param} entries must be non-empty strings", param=param)
    return items


def context_of(request: Request) -> ServerContext:
    ctx = request.app.state.ctx
    assert isinstance(ctx, ServerContext)
    return ctx


def now() -> int:
    return int(time.time())
