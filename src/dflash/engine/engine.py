"""`Engine`: one target model, its tokenizer and optionally a DFlash drafter, serving requests from any thread.

With `max_batch` > 1 concurrent `generate` calls decode together: the engine loop (`dflash.batch`) runs one batched
step over every active request. With `max_batch` 1 they run one at a time through the single-request loops (the
path of the GPU's CUDA graphs and device-resident rounds). It chooses the decoding strategy per request (plain, or speculative when a drafter is loaded and the request
allows it), checks the context budget, and keeps the safety net: a speculative generation that ends with no
visible text is retried once with plain decoding, logged and counted. With `prefix_cache_mb` > 0 it owns a
prefix cache (`dflash.kv.prefix_cache`) that every strategy reads and fills, unless a request opts out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch

from dflash.batch.core import BatchCore, CoreSettings
from dflash.batch.loop import BatchLoop, Yielded
from dflash.batch.memory import default_pool_tokens, pool_floor_fits
from dflash.batch.policy import DEFAULT_MAX_STEP_ROWS
from dflash.batch.sequence import Sequence
from dflash.drafter.borrowed_heads import BorrowedHeads
from dflash.drafter.model import DFlashDrafter
from dflash.errors import DFlashError, GenerationError
from dflash.generation.autoregressive import decode_autoregressive
from dflash.generation.cached_prefill import cached_prefix_length
from dflash.generation.constraint_factory import ConstraintFactory
from dflash.generation.forwards import forwards_for, register_forwards
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest, GenerationResult, GenerationStats, TokenCallback
from dflash.generation.selection import TokenAgreement, TokenChooser
from dflash.kernels.openmp import release_thread_workers
from dflash.kv.prefix_cache import PrefixCache
from dflash.kv.recurrent import ROLLBACK_MAX_ROWS
from dflash.models.model import CausalLM
from dflash.special_text import SpecialTextGuard
from dflash.speculative.gate import GateCosts, SpeculationGate
from dflash.tokenizer import Tokenizer, conversation_text

log = logging.getLogger("dflash.engine")

SPEC_MODES = ("none", "linear", "ddtree")
# Tree budget per device class, the fastest measured (results/README.md, "Files": CPU defaults, GPU budget sweep).
DEFAULT_DDTREE_BUDGET = {"cpu": 4, "cuda": 32}
# On AMX tiles a verified row costs less, so a larger tree wins (results/README.md, "CPU with AMX tiles").
AMX_DDTREE_BUDGET = 8
# Drafts verified per linear round, absent: the whole block (results/README.md, "Files": CPU defaults).
DEFAULT_NUM_DRAFTS = {"cpu": 4}
# Requests decoding together per device class. A request alone still takes the single-request loops (on a GPU their
# graphed rounds, the fastest stream); on a GPU the default drops to 1 where the batched pool's floor does not fit
# beside them (`Engine._fit_default_batch`).
DEFAULT_MAX_BATCH = {"cpu": 8, "cuda": 8}


@dataclass(frozen=True)
class EngineOptions:
    """How an `Engine` decodes. Fields left None take the default of the device class; the engine keeps the
    resolved copy (`resolve_options`) as `Engine.options`."""

    spec: str = "ddtree"  # "none" | "linear" | "ddtree" (the fastest on a GPU and with AMX: results/README.md)
    prefill_chunk: int = 256
    max_ctx: int | None = None  # defaults to the model's max positions
    draft_window: int | None = None
    ddtree_budget: int | None = None  # None: the measured default of the device class (DEFAULT_DDTREE_BUDGET)
    num_drafts: int | None = None  # drafts verified per linear round (None: DEFAULT_NUM_DRAFTS, else block size - 1)
    prefix_cache_mb: float = 0.0  # memory budget of the prefix cache in MiB; 0 disables it
    cuda_graphs: bool = True  # on a CUDA device, replay decode steps, verifications and drafter rounds as graphs
    max_batch: int | None = None  # requests decoding together (None: DEFAULT_MAX_BATCH of the device class)
    kv_pool_tokens: int | None = None  # positions of the batched K/V pool (None: max_batch contexts, within 4x max_ctx)
    max_step_rows: int | None = None  # verified rows per batched step (None: the policy's device default)
    # with max_batch > 1, a request decoding alone takes the single-request loops until another one arrives
    single_request_path: bool = True
    # False: a lone linear or DDTree request on the CPU chooses per round between a speculative round and a plain
    # step from measured times (`dflash.speculative.gate`); True: it speculates every round
    always_speculate: bool = False


def resolve_options(options: EngineOptions, *, device: torch.device, has_drafter: bool,
                    tensor_parallel: bool, capturable: bool = True, hybrid: bool = False,
                    draft_elsewhere: bool = False) -> EngineOptions:
    """`options` with every default filled in for `device`; raises `DFlashError` for an unknown mode or batch.

    `hybrid` (a target with linear-attention layers): trees no larger than its state can replay.
    `draft_elsewhere` (the drafter on another device
    than the target): one request at a time, the single-request loops being the ones that move each round's
    features and scores between the devices."""
    if options.spec not in SPEC_MODES:
        raise DFlashError(f"unknown --spec {options.spec!r}; choose one of {', '.join(SPEC_MODES)}")
    kind = device.type
    max_batch = 1 if tensor_parallel else options.max_batch  # every rank mirrors one request's decisions
    if draft_elsewhere:
        if (max_batch or 1) > 1:
            raise DFlashError("a drafter on its own device (--draft-device) serves one request at a time: "
                              "give --max-concurrency 1")
        max_batch = 1
    resolved = replace(
        options,
        spec=options.spec if has_drafter else "none",
        ddtree_budget=DEFAULT_DDTREE_BUDGET.get(kind, 16) if options.ddtree_budget is None else options.ddtree_budget,
        num_drafts=DEFAULT_NUM_DRAFTS.get(kind) if options.num_drafts is None else options.num_drafts,
        # under tensor parallelism the graphs hold the all-reduces too; a target whose work depends on the data
        # (`CausalLM.capturable`: mixture-of-experts routing) cannot be captured
        cuda_graphs=options.cuda_graphs and capturable,
        max_batch=DEFAULT_MAX_BATCH.get(kind, 1) if max_batch is None else max_batch,
    )
    if resolved.max_batch is not None and resolved.max_batch < 1:
        raise DFlashError(f"max batch must be at least 1, got {resolved.max_batch}")
    if hybrid:
        resolved = _for_hybrid(resolved)
    return resolved


# a verification of more rows keeps no per-row inputs in the linear-attention state, so a tree's accepted path could
# not be replayed: the tree (its root and `budget` nodes) must fit
HYBRID_MAX_BUDGET = ROLLBACK_MAX_ROWS - 1


def _for_hybrid(options: EngineOptions) -> EngineOptions:
    """The options a hybrid (linear-attention) target can run, each change logged once at start-up."""
    budget = options.ddtree_budget if options.ddtree_budget is None else min(options.ddtree_budget, HYBRID_MAX_BUDGET)
    hybrid = replace(options, ddtree_budget=budget)
    reasons = {
        "ddtree_budget": f"a tree's rows must be replayable from the recurrent state: DDTree budget {budget}",
    }
    for field, reason in reasons.items():
        if getattr(options, field) != getattr(hybrid, field):
            log.info("hybrid model (linear-attention layers): %s", reason)
    return hybrid


class Engine:
    def __init__(
        self,
        target: CausalLM,
        tokenizer: Tokenizer,
        drafter: DFlashDrafter | None = None,
        options: EngineOptions | None = None,
        *,
        model_name: str = "model",
    ) -> None:
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        # a drafter on another device than the target keeps copies of the target's embedding and LM head there
        self.draft_heads: BorrowedHeads | None = None
        if drafter is not None and drafter.fc.weight.device != self.device:
            from dflash.drafter.dflash2 import DFlash2Drafter

            if isinstance(drafter, DFlash2Drafter):  # its selector's rounds read the target's head directly
                raise DFlashError("a DFlash2 drafter runs on the target's device (no --draft-device)")
            self.draft_heads = BorrowedHeads(target, drafter.fc.weight.device)
        self.options = resolve_options(
            options or EngineOptions(),
            device=self.device,
            has_drafter=drafter is not None,
            tensor_parallel=getattr(target, "tensor_parallel", None) is not None,
            capturable=getattr(target, "capturable", True),
            hybrid=target.config.is_hybrid,
            draft_elsewhere=self.draft_heads is not None,
        )
        self.model_name = model_name
        self.cpu_matmul: str | None = None  # kernel of the quantized CPU matrices (float32 | amx | int8), set by the loader
        # Under tensor parallelism: how the ranks agree on each token choice (`dflash.parallel.spmd`).
        self.agreement: TokenAgreement | None = None
        self.max_ctx = self.options.max_ctx or target.config.max_position_embeddings
        self.eos_ids = tuple(dict.fromkeys((*tokenizer.eos_token_ids, *target.config.eos_token_ids)))
        self.step_observer: Callable[[int], None] | None = None  # called after each batched step with its size
        # round times of lone speculative requests on the CPU, per mode (host-clocked, so only on a synchronous
        # device; not under tensor parallelism, whose ranks must take the same rounds)
        gated = self.device.type == "cpu" and not self.options.always_speculate
        tensor_parallel = getattr(target, "tensor_parallel", None) is not None
        self.gate_costs: dict[str, GateCosts] | None = (
            {"linear": GateCosts(), "ddtree": GateCosts()} if gated and not tensor_parallel else None
        )
        self._serial = threading.Lock()  # max_batch 1: one generation at a time
        self._loop: BatchLoop | None = None
        self._closed_pauses = (0, 0)  # speculation pauses of engine loops stopped since (pauses, requests made plain)
        self._loop_lock = threading.Lock()
        if self.options.cuda_graphs and self.device.type == "cuda" and target.config.is_hybrid:
            from dflash.kernels.triton_delta_rule import delta_rule_program_serves

            if not delta_rule_program_serves(target.embed_tokens.weight):
                log.info("hybrid model: the delta rule's Triton program is off or missing: eager forwards")
                self.options = replace(self.options, cuda_graphs=False)
        if self.options.cuda_graphs and self.device.type == "cuda":
            from dflash.fastpath.runner import MAX_GRAPH_ROWS, attach_graph_runner

            block = drafter.config.block_size if drafter is not None else 1
            attach_graph_runner(
                target, drafter, capacity=self.max_ctx + 2 * MAX_GRAPH_ROWS + block, draft_heads=self.draft_heads
            )
        # a batch or a pool the caller chose is kept whatever the memory
        self._batch_chosen = options is not None and (options.max_batch, options.kv_pool_tokens) != (None, None)
        self._fit_default_batch()
        if self.draft_heads is not None:
            from dflash.generation.draft_device import DraftDeviceForwards

            register_forwards(target, DraftDeviceForwards(forwards_for(target), self.draft_heads, self.device))
        self._prefix_cache: PrefixCache | None = None
        if self.options.prefix_cache_mb > 0:
            self._prefix_cache = PrefixCache(
                int(self.options.prefix_cache_mb * 2**20),
                block_tokens=max(1, self.options.prefill_chunk),  # blocks end on the cold prefill's chunk grid
                feature_layers=drafter.config.target_layer_ids if drafter is not None else (),
            )

    def _fit_default_batch(self) -> None:
        """On a GPU, the default batch only where the batched pool's floor (one full context) fits the memory left
        beside the weights and the single-request path's cache: a model that only just fits keeps one request at a
        time rather than running out of memory at the first concurrent request."""
        if self.device.type != "cuda" or not self.batched or self._batch_chosen:
            return
        if pool_floor_fits(self.target, self.drafter, max_ctx=self.max_ctx, round_rows=self._round_rows):
            return
        log.info("one request at a time: a batched K/V pool of one full context (%d positions) does not fit in half "
                 "the free GPU memory; give --max-ctx to shrink it, or --max-concurrency and --kv-pool-tokens",
                 self.max_ctx)
        self.options = replace(self.options, max_batch=1)

    @property
    def _round_rows(self) -> int:
        """The most rows a round writes past a request's committed positions."""
        block = self.drafter.config.block_size if self.drafter is not None else 1
        return block + (self.options.ddtree_budget or 0)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self._prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, cache: PrefixCache | None) -> None:
        """Replace the prefix cache (every strategy, and the engine loop, read the new one from the next request)."""
        self._prefix_cache = cache
        if self._loop is not None:
            self._loop.core.prefix_cache = cache

    @property
    def vocab_size(self) -> int:
        return int(self.target.config.vocab_size)

    @property
    def device(self) -> torch.device:
        return self.target.embed_tokens.weight.device

    @cached_property
    def constraints(self) -> ConstraintFactory:
        """Builds token constraints for this model's vocabulary (tool names, grammars), for `request.constraint`."""
        return ConstraintFactory(self.tokenizer, self.target.config.vocab_size, self.eos_ids)

    def warm_up(self) -> int:
        """Capture the CUDA graphs of the first decode shapes now rather than during the first request: one short
        generation with the engine's strategy, or the batched step's shapes up to a few thousand keys. Returns the
        forwards served by the graph runner, or the graphs captured for the batched step (0 without graphs).
        On the CPU the same short generation builds the CPU kernels (compiled at their first use: about half a
        minute each on a new machine) and the native layers' description, rather than the first request."""
        from dflash.fastpath.dispatch import graph_runner_of

        if self.batched and self.device.type == "cuda" and self.options.cuda_graphs:
            started = time.perf_counter()
            captured = self.loop.core.capture_graphs(chains=self.options.spec == "linear")
            log.info("warm-up: %d CUDA graphs of the batched step captured in %.1f s", captured,
                     time.perf_counter() - started)
            if self.options.single_request_path and graph_runner_of(self.target) is not None:
                self.generate(self.warm_up_request())  # alone: the single-request path's first graphs too
            return captured
        runner = graph_runner_of(self.target)
        if runner is None:
            if self.device.type == "cpu":
                self.generate(self.warm_up_request())
                if self.gate_costs is not None:  # the gate's round times start from requests', not a first run's
                    self.gate_costs = {mode: GateCosts() for mode in self.gate_costs}
            return 0
        self.generate(self.warm_up_request())
        release_thread_workers()  # requests decode on other threads (`dflash.kernels.openmp`)
        log.info("warm-up: %d CUDA graphs captured", runner.captured)
        return runner.served

    def warm_up_request(self) -> GenerationRequest:
        """The short generation whose rounds capture the first graphs (`warm_up`)."""
        rows = self.drafter.config.block_size if self.drafter is not None else 1
        return GenerationRequest(
            prompt_ids=self.encode("Hello"), max_new_tokens=4 * rows + 2, ignore_eos=True, use_prefix_cache=False
        )

    # ---- prompts -----------------------------------------------------------------------------------------
    def chat_prompt_ids(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                        add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        guard = self.tokenizer.special_text_guard()  # special-token text typed in a message stays text
        text = self.tokenizer.apply_chat_template(
            guard.protect(messages), tools=guard.protect(tools) if tools is not None else None,
            add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self.encode(text, guard)

    def prompt_set_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """A prompt set's conversation (benchmarks): through the chat template, or for a base model without one,
        its text as a completion prompt (`conversation_text`)."""
        if self.tokenizer.chat_template:
            return self.chat_prompt_ids(messages)
        return self.encode(conversation_text(messages))

    def encode(self, text: str, guard: SpecialTextGuard | None = None) -> list[int]:
        """Token ids of `text`, BOS first where the model wants one. With `guard` (a chat prompt rendered from the
        guard's protected conversation) only the template's own special tokens are control tokens."""
        ids = guard.encode(text) if guard is not None else self.tokenizer.encode(text)
        bos = self.tokenizer.bos_token_id
        if self.tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    # ---- generation --------------------------------------------------------------------------------------
    def check_request(self, request: GenerationRequest) -> None:
        if not request.prompt_ids:
            raise GenerationError("the prompt is empty")
        if request.max_new_tokens < 1:
            raise GenerationError(f"max tokens must be at least 1, got {request.max_new_tokens}")
        vocab = self.target.config.vocab_size
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise GenerationError(f"prompt token ids {bad[:5]} are outside the vocabulary of {vocab}")
        total = len(request.prompt_ids) + request.max_new_tokens
        if total > self.max_ctx:
            raise GenerationError(
                f"prompt ({len(request.prompt_ids)} tokens) + max tokens ({request.max_new_tokens}) = {total} "
                f"exceeds the context limit of {self.max_ctx} tokens"
            )

    def spec_mode_for(self, request: GenerationRequest, spec: str | None) -> str:
        mode = spec or self.options.spec
        if mode not in SPEC_MODES:
            raise GenerationError(f"unknown spec mode {mode!r}")
        if self.drafter is None or request.sampling.penalised:
            return "none"  # penalties depend on every earlier token: plain decoding applies them exactly
        return mode

    def cached_prompt_tokens(self, request: GenerationRequest) -> int:
        """Leading prompt tokens of `request` the prefix cache could restore now (0 when it has none or the request
        opts out): what a stream reports before generation starts; the generation's stats carry the exact figure."""
        prefix_cache = self.prefix_cache if request.use_prefix_cache else None
        return cached_prefix_length(prefix_cache, request.prompt_ids, chunk=self.options.prefill_chunk)

    def generate(
        self,
        request: GenerationRequest,
        *,
        on_text: TokenCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
        spec: str | None = None,
    ) -> GenerationResult:
        self.check_request(request)
        mode = self.spec_mode_for(request, spec)
        result = self._run(request, mode, on_text, should_stop)
        if mode != "none" and result.finish_reason != "cancelled" and not result.text.strip():
            log.warning("speculative generation produced no visible text; retrying with plain decoding")
            retry = self._run(request, "none", on_text, should_stop)
            retry.stats.fallbacks = result.stats.fallbacks + 1
            retry.stats.rounds = result.stats.rounds
            return retry
        return result

    @property
    def options(self) -> EngineOptions:
        """The resolved decoding options."""
        return self._options

    @options.setter
    def options(self, options: EngineOptions) -> None:
        """Replace the decoding options (benchmarks try tree budgets this way). The batched core copies its settings
        when it is made, so an engine loop made with other options is stopped: the next batched generation starts
        one with these."""
        previous = getattr(self, "_options", None)
        self._options = options
        if previous is not None and previous != options:
            self.close()

    @property
    def batched(self) -> bool:
        """Whether concurrent generations decode together (the engine loop) rather than one at a time."""
        return (self.options.max_batch or 1) > 1

    @property
    def loop(self) -> BatchLoop:
        """The engine loop, started on first use."""
        with self._loop_lock:
            if self._loop is None:
                alone = self._run_alone if self.options.single_request_path else None
                self._loop = BatchLoop(self._new_core(), on_step=self._observe_step, alone=alone)
            return self._loop

    def _observe_step(self, size: int) -> None:
        if self.step_observer is not None:
            self.step_observer(size)

    def _new_core(self) -> BatchCore:
        max_batch = self.options.max_batch or 1
        block = self.drafter.config.block_size if self.drafter is not None else 1
        pool_tokens = self.options.kv_pool_tokens or default_pool_tokens(
            self.target, self.drafter, max_batch=max_batch, max_ctx=self.max_ctx, round_rows=self._round_rows
        )
        settings = CoreSettings(
            max_batch=max_batch,
            prefill_chunk=self.options.prefill_chunk,
            pool_tokens=pool_tokens,
            ddtree_budget=self.options.ddtree_budget or 0,
            linear_drafts=self.options.num_drafts or block - 1,
            max_step_rows=self.options.max_step_rows or DEFAULT_MAX_STEP_ROWS.get(self.device.type, 64),
            draft_window=self.options.draft_window,
            cuda_graphs=self.options.cuda_graphs,
            prefill_chunks_per_step=8 if self.device.type == "cuda" else 1,  # a GPU prefills 2K tokens in a few ms
        )
        return BatchCore(self.target, self.drafter, self.eos_ids, settings, self.prefix_cache)

    def close(self) -> None:
        """Stop the engine loop (generations still running end with an error)."""
        with self._loop_lock:
            if self._loop is not None:
                self._closed_pauses = self.speculation_pauses()
                self._loop.stop()
                self._loop = None

    def speculation_pauses(self) -> tuple[int, int]:
        """(times speculation paused under load, speculative requests it made plain) since the engine was made
        (`dflash.batch.speculation_pause`); read from the running engine loop without starting one."""
        pause = self._loop.core.pause if self._loop is not None else None
        pauses, requests = self._closed_pauses
        if pause is None:
            return pauses, requests
        return pauses + pause.pauses, requests + pause.paused_requests

    def _run(
        self,
        request: GenerationRequest,
        mode: str,
        on_text: TokenCallback | None,
        should_stop: Callable[[], bool] | None,
    ) -> GenerationResult:
        eos = () if request.ignore_eos else (*self.eos_ids, *request.stop_token_ids)
        sink = OutputSink(
            self.tokenizer.decode, eos_ids=eos, max_new_tokens=request.max_new_tokens, stop=request.stop,
            on_text=on_text,
        )
        chooser = TokenChooser(
            request.sampling, eos_ids=eos, min_tokens=request.min_tokens,
            vocab_size=self.target.config.vocab_size, device=self.device,
            constraint=request.constraint.start() if request.constraint is not None else None,
            agreement=self.agreement,
        )
        if self.batched:
            return self.loop.run(Sequence(request, mode, sink, chooser, should_stop))
        with self._serial:
            stats = self._decode(mode, request, sink, chooser, should_stop)
        assert sink.finish_reason is not None
        return GenerationResult(
            text=sink.text, token_ids=sink.token_ids, finish_reason=sink.finish_reason, stats=stats,
            stop_reason=sink.stop_reason,
        )

    def _run_alone(self, seq: Sequence, yield_now: Callable[[], bool]) -> bool:
        """`seq` through the single-request loops on the engine loop's thread (`dflash.batch.loop`): True once it is
        done, False when it stopped at a round because another request arrived (it then continues batched)."""

        def should_stop() -> bool:
            if seq.stop_requested():
                return True
            if yield_now():
                raise Yielded
            return False

        try:
            with self._serial:
                seq.stats = self._decode(seq.mode, seq.request, seq.sink, seq.chooser, should_stop)
        except Yielded:
            if not seq.sink.finished:
                return False
        except Exception as exc:  # its computation failed: this request ends with the error, the loop goes on
            log.exception("generation failed")
            seq.finish(exc)
            return True
        seq.finish()
        return True

    def _decode(
        self,
        mode: str,
        request: GenerationRequest,
        sink: OutputSink,
        chooser: TokenChooser,
        should_stop: Callable[[], bool] | None,
    ) -> GenerationStats:
        chunk = self.options.prefill_chunk
        prefix_cache = self.prefix_cache if request.use_prefix_cache else None
        if mode == "none" or self.drafter is None:
            return decode_autoregressive(
                self.target, request, sink, chooser, prefill_chunk=chunk, should_stop=should_stop,
                prefix_cache=prefix_cache,
            )
        if mode == "linear":
            from dflash.speculative.linear import decode_linear

            return decode_linear(
                self.target, self.drafter, request, sink, chooser, prefill_chunk=chunk,
                draft_window=self.options.draft_window, num_drafts=self.options.num_drafts, should_stop=should_stop,
                prefix_cache=prefix_cache, gate=self._gate(mode, request),
            )
        from dflash.speculative.ddtree import decode_ddtree

        return decode_ddtree(
            self.target, self.drafter, request, sink, chooser, prefill_chunk=chunk,
            budget=self.options.ddtree_budget or 0, draft_window=self.options.draft_window, should_stop=should_stop,
            prefix_cache=prefix_cache, gate=self._gate(mode, request),
        )

    def _gate(self, mode: str, request: GenerationRequest) -> SpeculationGate | None:
        """A gate for a lone linear or DDTree request on the CPU. Not for a sampled request with a seed: sampling
        draws its numbers in a different order in rounds and in plain steps, so a seed reproduces its text only if
        every run mixes them alike, which measured choices do not."""
        if self.gate_costs is None or (request.sampling.seed is not None and not request.sampling.greedy):
            return None
        return SpeculationGate(self.gate_costs[mode])

