"""Compiling and loading the CPU kernels: quantized-weights products in float32 (`quant_matmul.cpp`), on AMX
tiles with bf16 inputs (`amx_matmul.cpp`) and as integer dot products with int8 inputs (`int8_matmul.cpp`), and
the fused layer operations (`cpu_layer_ops.cpp`) and the native decoder layers that call them (`cpu_decoder.cpp`).

Each extension is built once with `torch.utils.cpp_extension.load` (g++ and ninja) into
`<cache root>/kernels/<key>/`, where the key hashes the source and the shared headers, the compiler flags, the compiler, the torch
and Python versions and the CPU's feature flags (`-march=native` builds for the machine it runs on, so a
cache shared between machines must not hand one machine's build to another). Later processes import the
built library directly, without a compiler. A failed build raises `KernelUnavailable` with the reason;
the failure is remembered for the rest of the process.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Protocol, cast

import torch

from dflash import environment
from dflash.cache_paths import cache_root
from dflash.errors import DFlashError

__all__ = [
    "BUILD_FLAGS",
    "AmxKernel",
    "CudaRowsKernel",
    "DecoderKernel",
    "Int8Kernel",
    "KernelUnavailable",
    "LayerOpsKernel",
    "QuantKernel",
    "kernel_source",
    "load_amx_kernel",
    "load_cuda_rows_kernel",
    "load_decoder_kernel",
    "load_int8_kernel",
    "load_layer_ops",
    "load_quant_kernel",
]

log = logging.getLogger(__name__)

SOURCE_NAME = "quant_matmul.cpp"
LAYER_OPS_SOURCE = "cpu_layer_ops.cpp"
AMX_SOURCE = "amx_matmul.cpp"
INT8_SOURCE = "int8_matmul.cpp"
DECODER_SOURCE = "cpu_decoder.cpp"
CUDA_ROWS_SOURCE = "cuda_nibble_rows.cu"
# -ffp-contract=off: no multiply-add fusion chosen by the compiler (see the source's batch-invariance note).
BUILD_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)


class KernelUnavailable(DFlashError):
    """A compiled kernel cannot be built or loaded here; the message says why."""


class QuantKernel(Protocol):
    """The functions the compiled extension exports."""

    matmul_capsule: object  # the matmul function's pointer, for the native decoder layers (`cpu_decoder.cpp`)
    panel_matmul_capsule: object  # `panel_matmul`'s, likewise

    def matmul(self, x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
        """x: [M, K] float32, blocks: [N, bytes per row] uint8 -> [M, N] float32."""
        ...

    def dequantize(self, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
        """blocks: [R, bytes per row] uint8 -> [R, k] float32."""
        ...

    def isa(self) -> str:
        """avx512, avx2 or generic."""
        ...


class AmxKernel(Protocol):
    """The functions `amx_matmul.cpp` exports."""

    matmul_capsule: object  # the matmul function's pointer, for the native decoder layers (`cpu_decoder.cpp`)
    panel_matmul_capsule: object  # `panel_matmul`'s, likewise

    def matmul(self, x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
        """x: [M, K] float32, blocks: [N, bytes per row] uint8 -> [M, N] float32 (bf16 products, float32 sums)."""
        ...

    def available(self) -> bool:
        """Whether the build has AMX and the process may use the tile state."""
        ...


class Int8Kernel(Protocol):
    """The functions `int8_matmul.cpp` exports."""

    matmul_capsule: object  # the matmul function's pointer, for the native decoder layers (`cpu_decoder.cpp`)
    panel_matmul_capsule: object  # `panel_matmul`'s, likewise

    def matmul(
        self, x: torch.Tensor, blocks: torch.Tensor, qtype: int, tiles: bool = True, parts: int = 1
    ) -> torch.Tensor:
        """x: [M, K] float32, blocks: [N, bytes per row] uint8 -> [M, N] float32 (x quantised to int8 blocks,
        integer dot products, float32 sums). `tiles`: several rows may run on AMX-INT8 tiles where the CPU has them
        (the same values either way). `parts` 2: each input block rounded to two 8-bit parts (about 15 bits)."""
        ...

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [M, K] float32 -> (int8 [M, K], float32 scales [M, K / 32]), the inputs the products use."""
        ...

    def available(self) -> bool:
        """Whether the build has an integer dot product path (AVX-512 VNNI, AVX-VNNI or AVX2)."""
        ...

    def has_tiles(self) -> bool:
        """Whether products of several input rows run on AMX-INT8 tiles here."""
        ...

    def isa(self) -> str:
        """avx512-vnni, avx-vnni, avx2 or none."""
        ...

    def panels_available(self) -> bool:
        """Whether the products here read weight panels (`int8_panels.h`: AVX-512 VNNI builds)."""
        ...

    def to_panels(self, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
        """blocks: [N, bytes per row] uint8 (Q4_0, Q4_1 or Q8_0 rows) -> [ceil(N / 16), ...] uint8 weight panels."""
        ...

    def panel_rows(self, panels: torch.Tensor, qtype: int, ids: torch.Tensor) -> torch.Tensor:
        """panels, ids: [R] int64 -> the GGUF rows [R, bytes per row] uint8 they hold."""
        ...

    def panel_matmul(self, x: torch.Tensor, panels: torch.Tensor, qtype: int, n: int, parts: int = 1) -> torch.Tensor:
        """x: [M, K] float32, panels of n rows -> [M, n] float32, bitwise `matmul` of the rows they hold."""
        ...


class LayerOpsKernel(Protocol):
    """The functions `cpu_layer_ops.cpp` exports (float32 CPU tensors; every output row from its own input row)."""

    # the functions' pointers, for the native decoder layers (`cpu_decoder.cpp`)
    rms_norm_capsule: object
    rotary_capsule: object
    attention_capsule: object
    attention_segments_capsule: object
    silu_mul_capsule: object

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, adds_one: bool) -> torch.Tensor:
        """x: [..., D], weight: [D] -> [..., D]."""
        ...

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, H, S, D], cos/sin: [B or 1, 1, S, D] -> [B, H, S, D] contiguous."""
        ...

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        """q: [B, H, S, D], k/v: [B, KVH, L, D], mask: [B or 1, 1, S, L] bool or None -> [B, S, H * D]."""
        ...

    def attention_slots(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """q: [H, S, D], k_pool/v_pool: [KVH, P, D] (one layer of a paged pool), slots: int64 [L] in [0, P),
        mask: [S, L] bool or None -> [S, H * D], bitwise `attention` over `k_pool[:, slots]`, `v_pool[:, slots]`
        (the keys read in place through the slots, not gathered)."""
        ...

    def attention_segments(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        starts: list[int],
        counts: list[int],
        slots: list[torch.Tensor],
        masks: list[torch.Tensor | None],
        scale: float,
    ) -> torch.Tensor:
        """q: [H, R, D], every request's rows of a packed forward; segment i: rows [starts[i], starts[i] + counts[i])
        (together [0, R), in order) read `slots[i]` under `masks[i]` ([counts[i], len(slots[i])] bool or None) ->
        [R, H * D], bitwise each segment's `attention_slots` side by side, in one parallel region."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [..., 2I] -> silu(gate) * up [..., I]."""
        ...

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [rows, vocab] -> int64 [rows], exactly torch.argmax(logits, dim=-1)."""
        ...


class CudaRowsKernel(Protocol):
    """What `cuda_nibble_rows.cu` exports."""

    def nibble_rows(
        self, high: torch.Tensor, low: torch.Tensor, scale: torch.Tensor, total: torch.Tensor,
        half_total: torch.Tensor, words: torch.Tensor, tops: torch.Tensor, pairs: torch.Tensor, sub: torch.Tensor,
        out: torch.Tensor, format: int, parts: int,
    ) -> None:
        """out[rows, n] = x @ W^T for x's 8-bit parts (`QuantizedInput`) and W's words (`NibbleMatrix`)."""
        ...


class DecoderKernel(Protocol):
    """What `cpu_decoder.cpp` exports: `bind` takes the other extensions' function capsules; `Product`, `Linear`,
    `Norm`, `Layer`, `Segment` and `DecoderStack` describe and run a target's decoder layers
    (`dflash.models.native_stack`), `DrafterLayer` and `DrafterStack` a drafter's (`dflash.drafter.native_drafter`)."""

    def bind(self, int8_matmul: object, float_matmul: object, amx_matmul: object, rms_norm: object, rotary: object,
             attention: object, attention_segments: object, silu_mul: object, panel_matmul: object = None) -> None: ...

    Product: type
    Linear: type
    Norm: type
    Layer: type
    Segment: type
    DecoderStack: type
    DrafterLayer: type
    DrafterStack: type


_lock = threading.Lock()
_loaded: dict[tuple[str, ...], object] = {}
_failed: dict[tuple[str, ...], str] = {}


def kernel_source(name: str = SOURCE_NAME) -> Path:
    return Path(__file__).with_name(name)


def load_quant_kernel(extra_flags: tuple[str, ...] = ()) -> QuantKernel:
    """The compiled quantized-weights kernel (built on first use); `extra_flags` are appended to `BUILD_FLAGS`
    (tests use them to build the narrower instruction-set paths)."""
    return cast(QuantKernel, _load(SOURCE_NAME, "dflash_quant", (*BUILD_FLAGS, *extra_flags)))


def load_amx_kernel() -> AmxKernel:
    """The compiled AMX kernel (built on first use). Built on any x86 CPU; `available()` is False where the CPU
    or the compiler lacks AMX (the build then holds only that answer)."""
    return cast(AmxKernel, _load(AMX_SOURCE, "dflash_amx", BUILD_FLAGS))


def load_int8_kernel(extra_flags: tuple[str, ...] = ()) -> Int8Kernel:
    """The compiled int8-inputs kernel (built on first use); `extra_flags` are appended to `BUILD_FLAGS` (tests
    use them to build the narrower instruction-set paths). `available()` is False on CPUs without AVX2."""
    return cast(Int8Kernel, _load(INT8_SOURCE, "dflash_int8", (*BUILD_FLAGS, *extra_flags)))


def load_layer_ops(extra_flags: tuple[str, ...] = ()) -> LayerOpsKernel:
    """The compiled fused layer operations (built on first use); `extra_flags` are appended to `BUILD_FLAGS`
    (tests use them to build the portable paths)."""
    return cast(LayerOpsKernel, _load(LAYER_OPS_SOURCE, "dflash_layer_ops", (*BUILD_FLAGS, *extra_flags)))


def load_cuda_rows_kernel() -> CudaRowsKernel:
    """The CUDA products of 1-8 rows with GGUF words (`cuda_nibble_rows.cu`, built with nvcc on first use, for the
    current GPU's architecture); `KernelUnavailable` without a CUDA device or a CUDA compiler."""
    if not torch.cuda.is_available():
        raise KernelUnavailable("no CUDA device")
    major, minor = torch.cuda.get_device_capability()
    # the architecture is part of the build's key (nvcc builds for the device it finds)
    return cast(CudaRowsKernel, _load(CUDA_ROWS_SOURCE, "dflash_cuda_rows", ("-O3", f"-DDFLASH_CUDA_ARCH={major}{minor}")))


def load_decoder_kernel() -> DecoderKernel:
    """The compiled native decoder layers (built on first use), before `bind` (`dflash.kernels.native_decoder`)."""
    return cast(DecoderKernel, _load(DECODER_SOURCE, "dflash_decoder", BUILD_FLAGS))


def _load(source_name: str, prefix: str, flags: tuple[str, ...]) -> object:
    if not source_name.endswith(".cu"):
        flags = (*flags, *environment.cpu_kernel_flags())  # after -march=native, so they narrow it
    entry = (source_name, *flags)
    with _lock:
        if entry in _loaded:
            return _loaded[entry]
        if entry in _failed:
            raise KernelUnavailable(_failed[entry])
        try:
            kernel = _build_or_import(source_name, prefix, flags)
        except KernelUnavailable as exc:
            _failed[entry] = str(exc)
            raise
        _loaded[entry] = kernel
        return kernel


def _build_or_import(source_name: str, prefix: str, flags: tuple[str, ...]) -> object:
    source = kernel_source(source_name)
    try:
        text = source.read_bytes()
        for header in sorted(source.parent.glob("*.h")):  # shared headers change the build too
            text += header.read_bytes()
    except OSError as exc:
        raise KernelUnavailable(f"the kernel source {source} cannot be read: {exc.strerror or exc}") from None
    key = _build_key(text, flags)
    name = f"{prefix}_{key}"
    directory = cache_root() / "kernels" / key
    built = _built_library(directory, name)
    if built is not None:
        try:
            return _import_library(name, built)
        except ImportError as exc:
            log.warning("rebuilding the kernel %s: %s", source_name, exc)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelUnavailable(f"cannot create the kernel build directory {directory}: {exc.strerror or exc}") from None
    log.warning("building the kernel %s into %s (first use only; about a minute)", source_name, directory)
    _put_interpreter_scripts_on_path()
    try:
        from torch.utils.cpp_extension import load

        module = load(
            name=name,
            sources=[str(source)],
            extra_cflags=list(flags),
            extra_cuda_cflags=["-O3"] if source_name.endswith(".cu") else None,
            extra_ldflags=list(LINK_FLAGS),
            build_directory=str(directory),
            verbose=False,
        )
    except Exception as exc:  # compiler missing, compile error, ninja missing, import error...
        raise KernelUnavailable(f"building the kernel {source_name} failed: {_first_lines(str(exc))}") from None
    return module


def _put_interpreter_scripts_on_path() -> None:
    """The `ninja` the `ninja` package installs sits beside the interpreter (a venv's bin/), which need not be on
    PATH when the venv is not activated; torch's builder looks it up on PATH."""
    scripts = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if scripts not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(p for p in (scripts, path) if p)


def _built_library(directory: Path, name: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = directory / f"{name}{suffix}"
        if candidate.is_file():
            return candidate
    plain = directory / f"{name}.so"
    return plain if plain.is_file() else None


def _import_library(name: str, path: Path) -> object:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not an importable extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_key(source: bytes, flags: tuple[str, ...]) -> str:
    parts = [
        hashlib.sha256(source).hexdigest(),
        " ".join(flags),
        " ".join(LINK_FLAGS),
        os.environ.get("CXX", "c++"),
        torch.__version__,
        sys.implementation.cache_tag or "",
        platform.machine(),
        _cpu_flags(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), or the processor's name elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor()


def _first_lines(text: str, limit: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    shown = "; ".join(lines[:limit])
    return shown + (" ..." if len(lines) > limit else "")
