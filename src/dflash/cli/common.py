"""Options shared by several commands: model selection, decoding strategy, sampling."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from dflash.engine.engine import Engine, EngineOptions
from dflash.errors import DFlashError
from dflash.generation.sampling import SamplingParams

if TYPE_CHECKING:
    from dflash.parallel.group import TensorParallel


def add_model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model", default="default",
        help="HF folder, GGUF file, 'default' (SmolLM2-135M-Instruct) or 'gemma3-270m' (Gemma-3-270M base from its "
        "packages: text completion, 32K context)",
    )
    group.add_argument(
        "--draft", default=None,
        help="DFlash drafter folder, 'default' (the shipped drafter of the packaged model) or 'none'; "
        "the packaged models (default, gemma3-270m) use their shipped drafters unless 'none' is given",
    )
    group.add_argument(
        "--spec", default="ddtree", choices=["none", "linear", "ddtree"],
        help="decoding strategy: ddtree (default: the drafter's block verified as a tree of its likeliest "
        "continuations, the fastest on a GPU and on CPUs with AMX; on a CPU a request alone takes plain steps where "
        "they measure faster, see --always-speculate), linear (its single most likely chain) or none (plain decoding)",
    )
    group.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    group.add_argument(
        "--draft-device", default="auto", metavar="cuda:N",
        help="run the drafter on another GPU than the target (auto: the target's); it keeps copies of the target's "
        "embedding and LM head there and serves one request at a time",
    )
    group.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16")
    group.add_argument(
        "--weights", default="auto", choices=["auto", "dense", "quantized"],
        help="target weights: quantized GGUF blocks in Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K (through the CPU kernels on the "
        "CPU, Q4_0 and the K formats on int8 products only; through Triton programs on a GPU in bf16/fp16), or dense; "
        "auto = quantized on CPU in float32 when every matrix is in those formats and the kernels build, dense "
        "otherwise (GPUs included)",
    )
    group.add_argument(
        "--draft-weights", default="auto", choices=["auto", "dense", "quantized"],
        help="drafter weights: quantized (Q8_0 blocks through the CPU kernel on the CPU, int8 rows through the "
        "skinny program on a GPU) or dense; auto = quantized on a GPU in bfloat16/float16 and when the target runs "
        "quantized on the CPU",
    )
    group.add_argument(
        "--draft-vocab", default="auto",
        help="tokens the drafter scores: auto (the drafter folder's draft_vocab.safetensors when it has one and runs "
        "on the CPU, else all), off (all), or a draft_vocab.safetensors file made by `dflash train vocab`",
    )
    group.add_argument(
        "--cpu-matmul", default="auto", choices=["auto", "float32", "amx", "int8", "int8x2"],
        help="kernel of the quantized matrices on the CPU: float32 products, amx (bf16 products on the AMX "
        "tiles of Intel Xeon CPUs, float32 sums: a verification of up to 16 rows costs about one row), int8x2 "
        "(inputs rounded to two 8-bit parts, about 15 bits: integer dot products, closer to float32 than bf16), or "
        "int8 (one 8-bit part, as llama.cpp's activations: changes answers more); auto = amx where the CPU has it "
        "and the engine speculates, else int8x2 where the CPU has AVX2, else float32; models with Q4_0 or K-format "
        "matrices run int8x2 (or int8): float32 and amx read Q4_1/Q8_0 only",
    )
    group.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per prefill forward")
    group.add_argument("--max-ctx", type=int, default=None, help="context limit (default: the model's)")
    group.add_argument("--draft-window", type=int, default=None, help="drafter attends to the last N positions only")
    group.add_argument("--num-drafts", type=int, default=None,
                       help="drafts verified per linear round (default: 4 on CPU, the whole block (block size - 1) on GPU)")
    group.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                       help="on a GPU, run every forward eagerly instead of replaying CUDA graphs")
    group.add_argument("--ddtree-budget", type=int, default=None,
                       help="tree nodes verified per round with --spec ddtree (default: 4 on CPU, 8 with AMX or AMX-INT8 "
                       "products, 32 on GPU; on a GPU under load each step may take a smaller tree, or a plain step, "
                       "where its measured times say so)")
    group.add_argument("--always-speculate", action="store_true",
                       help="with --spec ddtree or linear on the CPU, speculate every round (default: a request decoding alone "
                       "takes a plain step instead wherever its measured rounds say plain steps give more tokens "
                       "per second; the output is the same either way)")
    group.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                       help="requests decoded together in one batched step (`dflash serve` runs this many at once "
                       "and queues the rest); default: 8 (1 for generate and chat; on a GPU 1 where one more full "
                       "context of K/V does not fit in half the memory left after loading). A request alone takes "
                       "the single-request path either way")
    group.add_argument("--max-step-rows", type=int, default=None, metavar="N",
                       help="verified rows per batched step, shared by the speculating requests (default: 32 on the "
                       "CPU, 256 on a GPU)")
    group.add_argument("--kv-pool-tokens", type=int, default=None, metavar="N",
                       help="positions of K/V memory shared by the batched requests (default: min(batch, 4) "
                       "contexts); a request waits until its whole reservation fits")


def max_batch_from_args(args: argparse.Namespace) -> int | None:
    """--max-concurrency, checked (None: the engine's default)."""
    value: int | None = getattr(args, "max_concurrency", None)
    if value is not None and value < 1:
        raise DFlashError(f"--max-concurrency must be at least 1, got {value}")
    return value


DEFAULT_PREFIX_CACHE_MB = 2048.0  # about four 8K-token conversations of the default model (55 KB per position)


def add_prefix_cache_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefix-cache-mb", type=float, default=DEFAULT_PREFIX_CACHE_MB,
        help="memory for reusing the K/V and drafter features of repeated prompt prefixes, in MiB (0: off; "
        f"default {DEFAULT_PREFIX_CACHE_MB:g})",
    )


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed
    )


def engine_from_args(
    args: argparse.Namespace, tensor_parallel: TensorParallel | None = None, *, one_at_a_time: bool = False
) -> Engine:
    """The engine the flags describe; with `tensor_parallel`, this rank's share of it (`dflash.cli.ranks`).
    `one_at_a_time`: a command that never runs two requests at once (generate, chat) makes no batched core, whose
    K/V pool would take memory (on a GPU up to half of what is free) for nothing."""
    from dflash.engine.loading import LoadOptions, load_engine

    batching: dict[str, Any] = {}
    max_batch = max_batch_from_args(args)
    if max_batch is None and one_at_a_time:
        max_batch = 1
    if max_batch is not None:
        if "max_batch" not in {f.name for f in fields(EngineOptions)}:
            raise DFlashError("--max-concurrency: this engine decodes one request at a time")
        batching["max_batch"] = max_batch
    for flag, name in (("--max-step-rows", "max_step_rows"), ("--kv-pool-tokens", "kv_pool_tokens")):
        value = getattr(args, name, None)
        if value is not None:
            if value < 1:
                raise DFlashError(f"{flag} must be at least 1, got {value}")
            batching[name] = value
    options = EngineOptions(
        spec=args.spec, prefill_chunk=args.prefill_chunk, max_ctx=args.max_ctx, draft_window=args.draft_window,
        ddtree_budget=args.ddtree_budget, num_drafts=args.num_drafts,
        prefix_cache_mb=getattr(args, "prefix_cache_mb", 0.0), cuda_graphs=args.cuda_graphs,
        always_speculate=getattr(args, "always_speculate", False), **batching,
    )
    loading = LoadOptions(
        device=args.device, dtype=args.dtype, weights=args.weights, draft_weights=args.draft_weights,
        draft_vocab=args.draft_vocab, cpu_matmul=args.cpu_matmul, draft_device=getattr(args, "draft_device", "auto"),
    )
    return load_engine(args.model, args.draft, options=options, loading=loading, tensor_parallel=tensor_parallel)
