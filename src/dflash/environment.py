"""Every `DFLASH_*` environment variable dflash reads: its name, default, meaning and parsing.

| variable                       | default  | meaning                                                                 |
| ------------------------------ | -------- | ----------------------------------------------------------------------- |
| `DFLASH_CACHE_DIR`             | platform | where rebuildable files go: GGUF conversions, compiled kernels          |
|                                |          | (default: the platform's user cache dir, `dflash.cache_paths`)         |
| `DFLASH_NO_CACHE`              | off      | 1/true/yes/on: keep no converted GGUF on disk (`dflash.models.gguf_cache`) |
| `DFLASH_CPU_LAYER_OPS`         | on       | 0/false/no/off: torch operations instead of the fused CPU kernel        |
| `DFLASH_CPU_NATIVE_LAYERS`     | on       | 0/false/no/off: CPU decoder layers run from Python, not in one native   |
|                                |          | call (`dflash.models.native_stack`; the same values either way)         |
| `DFLASH_CPU_PANELS`            | on       | 0/false/no/off: int8 products read GGUF rows, not weight panels         |
|                                |          | (`kernels/int8_panels.h`; the same values either way)                   |
| `DFLASH_CPU_KERNEL_FLAGS`      | none     | compiler flags added to every CPU kernel build, after `-march=native`   |
|                                |          | (e.g. `-mno-avx512f`: the AVX2 paths on an AVX-512 CPU)                 |
| `DFLASH_ATTENTION`             | split    | split: the split-key Triton program for 2 to 128 query rows; sdpa: SDPA |
| `DFLASH_PADDED_ATTENTION`      | paged    | the batched padded step's attention: paged reads the K/V pool in place; |
|                                |          | gather copies each request's keys first, then SDPA                      |
| `DFLASH_BATCH_OVERLAP`         | on       | 0/false/no/off: the batched core reads each plain greedy step's tokens  |
|                                |          | before launching the next (on: the next is launched first)              |
| `DFLASH_DEVICE_TREES`          | on       | 0/false/no/off: batched greedy DDTree steps build their trees on the    |
|                                |          | host, not in one device round (`dflash.batch.device_trees`)             |
| `DFLASH_FLA`                   | on       | 0/false/no/off: Gated DeltaNet prompt chunks through the torch form,    |
|                                |          | not flash-linear-attention's kernels (CUDA, where installed)            |
| `DFLASH_DELTA_RULE_PROGRAM`    | on       | 0/false/no/off: Gated DeltaNet decode rows through the torch rule, not  |
|                                |          | the Triton program (CUDA); hybrids then decode without CUDA graphs      |
| `DFLASH_GGUF_INPUT`            | int8x2   | GPU products with GGUF 4/6-bit words: the inputs rounded to two 8-bit   |
|                                |          | parts (about 15 bits), or to one (int8: llama.cpp's precision, faster)  |
| `DFLASH_GGUF_ROWS`             | cuda     | GPU products of 1-8 rows with GGUF 4/6-bit words: the CUDA program      |
|                                |          | (built with nvcc on first use), or triton (the Triton program)          |
| `DFLASH_PRODUCTS`              | skinny   | skinny: the Triton products for few rows; cublas: cuBLAS everywhere     |
| `DFLASH_TP_ALLREDUCE`          | auto     | tensor-parallel sums: auto, nccl, symmetric, fused, oneway            |
| `DFLASH_TP_VOCAB_SPLIT`        | on       | 0: embeddings and LM head whole on every rank, not split by vocab rows  |
| `DFLASH_API_KEY`               | none     | the key `dflash serve` requires (`dflash.cli.api_key`)                  |
| `DFLASH_MIN_TOKENS`            | off      | agent stall recovery (`dflash.server.stall`): no EOS before N tokens    |
| `DFLASH_STALL_TOOL_PREFIX`     | off      | agent stall recovery: continue a turn that stops at an action preamble  |
| `DFLASH_DEGENERATE_RUN_TOKENS` | off      | agent stall recovery: N identical tokens in a row end the turn          |
| `DFLASH_LLAMA_BENCH`           | PATH     | llama.cpp's `llama-bench` for the `llama.cpp` mode of `bench speed`     |
|                                |          | (default: `llama-bench` on PATH; `dflash.bench.llama_cpp_peer`)         |

Each function reads its variable when called, never once at import: tests and benchmarks change them between
runs, and the GPU choices then apply from the next forward (so from the next graph capture). They take an optional
mapping in place of `os.environ`, for the callers that are handed one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from dflash.errors import DFlashError

CACHE_DIR = "DFLASH_CACHE_DIR"
NO_CACHE = "DFLASH_NO_CACHE"
CPU_LAYER_OPS = "DFLASH_CPU_LAYER_OPS"
CPU_NATIVE_LAYERS = "DFLASH_CPU_NATIVE_LAYERS"
CPU_PANELS = "DFLASH_CPU_PANELS"
CPU_KERNEL_FLAGS = "DFLASH_CPU_KERNEL_FLAGS"
ATTENTION = "DFLASH_ATTENTION"
PADDED_ATTENTION = "DFLASH_PADDED_ATTENTION"
BATCH_OVERLAP = "DFLASH_BATCH_OVERLAP"
DEVICE_TREES = "DFLASH_DEVICE_TREES"
FLA = "DFLASH_FLA"
DELTA_RULE_PROGRAM = "DFLASH_DELTA_RULE_PROGRAM"
PRODUCTS = "DFLASH_PRODUCTS"
GGUF_INPUT = "DFLASH_GGUF_INPUT"
GGUF_ROWS = "DFLASH_GGUF_ROWS"
TP_ALLREDUCE = "DFLASH_TP_ALLREDUCE"
TP_VOCAB_SPLIT = "DFLASH_TP_VOCAB_SPLIT"
API_KEY = "DFLASH_API_KEY"
MIN_TOKENS = "DFLASH_MIN_TOKENS"
STALL_TOOL_PREFIX = "DFLASH_STALL_TOOL_PREFIX"
DEGENERATE_RUN_TOKENS = "DFLASH_DEGENERATE_RUN_TOKENS"
LLAMA_BENCH = "DFLASH_LLAMA_BENCH"

PREFIX = "DFLASH_"
ATTENTION_CHOICES = ("split", "sdpa")  # the first is the default
PADDED_ATTENTION_CHOICES = ("paged", "gather")
PRODUCTS_CHOICES = ("skinny", "cublas")
GGUF_INPUT_CHOICES = ("int8x2", "int8")
GGUF_ROWS_CHOICES = ("cuda", "triton")
TP_ALLREDUCE_CHOICES = ("auto", "nccl", "symmetric", "fused", "oneway")

_OFF = frozenset({"", "0", "false", "no", "off", "none"})
_ON = frozenset({"1", "true", "yes", "on"})


def _environ(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def cache_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """`DFLASH_CACHE_DIR`, or None where it is unset or empty."""
    value = _environ(env).get(CACHE_DIR)
    return Path(value).expanduser() if value else None


def gguf_cache_enabled(env: Mapping[str, str] | None = None) -> bool:
    """False when `DFLASH_NO_CACHE` is 1, true, yes or on."""
    return _environ(env).get(NO_CACHE, "").strip().lower() not in _ON


def cpu_layer_ops_enabled(env: Mapping[str, str] | None = None) -> bool:
    """`DFLASH_CPU_LAYER_OPS`: on unless 0, false, no or off."""
    return _switched_on(env, CPU_LAYER_OPS)


def cpu_native_layers_enabled(env: Mapping[str, str] | None = None) -> bool:
    """`DFLASH_CPU_NATIVE_LAYERS`: on unless 0, false, no or off."""
    return _switched_on(env, CPU_NATIVE_LAYERS)


def cpu_panels_enabled(env: Mapping[str, str] | None = None) -> bool:
    """`DFLASH_CPU_PANELS`: on unless 0, false, no or off."""
    return _switched_on(env, CPU_PANELS)


def cpu_kernel_flags(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """`DFLASH_CPU_KERNEL_FLAGS`: the compiler flags it lists (split at whitespace), none by default."""
    return tuple(_environ(env).get(CPU_KERNEL_FLAGS, "").split())


def attention(env: Mapping[str, str] | None = None) -> str:
    """`DFLASH_ATTENTION`: "split" (the default) or "sdpa"; raises `ValueError` for anything else."""
    return _choice(_environ(env), ATTENTION, ATTENTION_CHOICES)


def padded_attention(env: Mapping[str, str] | None = None) -> str:
    """`DFLASH_PADDED_ATTENTION`: "paged" (the default) or "gather"; raises `ValueError` for anything else."""
    return _choice(_environ(env), PADDED_ATTENTION, PADDED_ATTENTION_CHOICES)


def _switched_on(env: Mapping[str, str] | None, name: str) -> bool:
    """A switch that is on unless set to 0, false, no or off."""
    return _environ(env).get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def batch_overlap_enabled(env: Mapping[str, str] | None = None) -> bool:
    """`DFLASH_BATCH_OVERLAP`: on unless 0, false, no or off (`dflash.batch.overlap`)."""
    return _switched_on(env, BATCH_OVERLAP)


def device_trees_enabled(env: Mapping[str, str] | None = None) -> bool:
    """`DFLASH_DEVICE_TREES`: on unless 0, false, no or off (`dflash.batch.device_trees`)."""
    return _switched_on(env, DEVICE_TREES)


def fla_enabled(env: Mapping[str, str] | None = None) -> bool:
    """`DFLASH_FLA`: on unless 0, false, no or off (`dflash.kernels.fla_delta_rule`)."""
    return _switched_on(env, FLA)


def delta_rule_program_enabled(env: Mapping[str, str] | None = None) -> bool:
    """`DFLASH_DELTA_RULE_PROGRAM`: on unless 0, false, no or off (`dflash.kernels.triton_delta_rule`)."""
    return _switched_on(env, DELTA_RULE_PROGRAM)


def gguf_input(env: Mapping[str, str] | None = None) -> str:
    """`DFLASH_GGUF_INPUT`: "int8x2" (the default) or "int8"; raises `ValueError` for anything else."""
    return _choice(_environ(env), GGUF_INPUT, GGUF_INPUT_CHOICES)


def gguf_rows(env: Mapping[str, str] | None = None) -> str:
    """`DFLASH_GGUF_ROWS`: "cuda" (the default) or "triton"; raises `ValueError` for anything else."""
    return _choice(_environ(env), GGUF_ROWS, GGUF_ROWS_CHOICES)


def products(env: Mapping[str, str] | None = None) -> str:
    """`DFLASH_PRODUCTS`: "skinny" (the default) or "cublas"; raises `ValueError` for anything else."""
    return _choice(_environ(env), PRODUCTS, PRODUCTS_CHOICES)


def tp_allreduce(env: Mapping[str, str] | None = None) -> str:
    """`DFLASH_TP_ALLREDUCE`: "auto" (the default), "nccl", "symmetric", "fused" or "oneway"; raises `ValueError` for anything else."""
    return _choice(_environ(env), TP_ALLREDUCE, TP_ALLREDUCE_CHOICES)


def tp_vocab_split(env: Mapping[str, str] | None = None) -> bool:
    """`DFLASH_TP_VOCAB_SPLIT`: on unless 0, false, no or off (`dflash.parallel.sharding.vocab_split`)."""
    return _switched_on(env, TP_VOCAB_SPLIT)


def api_key(env: Mapping[str, str] | None = None) -> str | None:
    """`DFLASH_API_KEY` as given (the caller checks it), or None where it is unset or blank."""
    value = _environ(env).get(API_KEY, "")
    return value if value.strip() else None


def llama_bench(env: Mapping[str, str] | None = None) -> Path | None:
    """`DFLASH_LLAMA_BENCH`: the `llama-bench` executable to run, or None where it is unset or blank."""
    value = _environ(env).get(LLAMA_BENCH, "").strip()
    return Path(value).expanduser() if value else None


def env_flag(env: Mapping[str, str], name: str) -> bool:
    """A switch read by meaning: 1/true/yes/on, or 0/false/no/off/none/empty (unset: off). Anything else raises
    `DFlashError` rather than being guessed at."""
    value = env.get(name, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise DFlashError(f"{name}={env[name]!r}: expected 1/0, true/false, yes/no or on/off")


def env_count(env: Mapping[str, str], name: str) -> int:
    """A count of tokens, 0 when unset or off; raises `DFlashError` for what is not a whole number >= 0."""
    value = env.get(name, "").strip().lower()
    if value in _OFF:
        return 0
    try:
        count = int(value)
    except ValueError:
        raise DFlashError(f"{name}={env[name]!r}: expected a whole number of tokens (0 or empty = off)") from None
    if count < 0:
        raise DFlashError(f"{name}={count}: must not be negative")
    return count


def variables_set(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every `DFLASH_*` variable that is set, by name, for the provenance of a measurement; the API key's value is
    replaced by "<set>" so that it never lands in a results file."""
    found = {name: value for name, value in sorted(_environ(env).items()) if name.startswith(PREFIX)}
    if API_KEY in found:
        found[API_KEY] = "<set>"
    return found


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    value = env.get(name, choices[0])
    if value not in choices:
        raise ValueError(f"{name} must be {' or '.join(repr(c) for c in choices)}, not {value!r}")
    return value
