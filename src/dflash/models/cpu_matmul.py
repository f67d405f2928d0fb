"""How the CPU kernel multiplies quantized matrices (`--cpu-matmul auto|float32|amx|int8|int8x2`).

* `float32`: `kernels/quant_matmul.cpp`, float32 products of float32 inputs with the dequantised weights (the
  reference values `d * q + m`); any CPU. Its cost grows with every input row: a 5-row verification costs about
  1.6 one-row steps on 2 cores.
* `amx`: `kernels/amx_matmul.cpp`, the same weights and inputs rounded to bfloat16, multiplied on the AMX tiles of
  Intel Xeon CPUs (4th generation on), summed in float32. Up to 16 input rows cost what one row costs, so
  speculative verification is nearly free in the products; the model computes with bf16 products as on a GPU.
* `int8`: `kernels/int8_matmul.cpp`, each input row quantised once per product to int8 blocks of 32 (a float32
  scale per block, as llama.cpp's Q8 activations), multiplied with the weights' own integers (nibbles unpacked in
  registers) by integer dot products (AVX-512 VNNI, AVX-VNNI or AVX2; 6 or more rows on AMX-INT8 tiles where the
  CPU has them), scaled and summed in float32 per block. The inputs' rounding moves a product by up to 1/254 of
  each block's largest input times the block's summed |weights|: enough to change the default model's answers
  (mean |logit change| about 0.23 against the float32 kernel; "What is the capital of France?" is answered
  "L'Étoile, la Marseillaise, ..." instead of "Paris", as llama.cpp, which rounds its inputs alike, answers it).
* `int8x2`: the same kernel with each input block rounded to two 8-bit parts (the first rounding's residual rounded
  again, about 15 bits) and two integer dot products per block: a product moves 256 times less than with one part
  (mean |logit change| 0.0013 on the default model, against 0.067 for bf16 products), at about the cost of one part
  for one row; verified rows cost more than on the bf16 tiles (two tile products per block).
* `auto`: amx where the CPU, the compiler and the kernel allow it and the engine speculates (its verified rows then
  cost about one); otherwise int8x2 where the CPU has AVX2 at least (faster than the float32 kernel at one row and
  at five, with the 512-bit and the 256-bit builds alike), float32 elsewhere.

Formats: the int8 kernel reads every GGUF format a quantized matrix is kept in (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K);
the float32 and amx kernels read Q4_1 and Q8_0 only. For a model with any matrix in another format (the common
Q4_K_M, Q4_0, Q5_K_M and Q6_K downloads) `auto` picks int8x2 (the reason names the formats), and an explicit
`float32` or `amx` is refused with `ModelLoadError` rather than switched silently: they would change the products'
rounding the user asked for. (On a CPU without AVX2 such a model loads dense weights: `weight_choice`.)

All kernels are batch invariant (a row's result does not depend on the other rows), so speculative decoding
reproduces plain decoding exactly under any; the choices can differ from each other in the last bits of a logit
and so, rarely, in a greedy token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from gguf import GGMLQuantizationType
from torch import nn

from dflash.errors import ModelLoadError
from dflash.kernels.build import KernelUnavailable, load_amx_kernel, load_int8_kernel
from dflash.models.gguf_transcode import effective_format
from dflash.models.quantized_layers import QuantizedEmbedding, QuantizedLinear
from dflash.models.quantized_weights import float_kernels_read, is_supported_type

__all__ = [
    "CPU_MATMUL_OPTIONS", "MatmulChoice", "choose_cpu_matmul", "draft_products", "tile_products", "use_cpu_matmul",
]

log = logging.getLogger(__name__)

CPU_MATMUL_OPTIONS = ("auto", "float32", "amx", "int8", "int8x2")


@dataclass(frozen=True)
class MatmulChoice:
    kind: str  # float32 | amx | int8 | int8x2
    reason: str


def amx_obstacle() -> str | None:
    """Why the AMX kernel cannot run here, or None."""
    try:
        kernel = load_amx_kernel()
    except KernelUnavailable as exc:
        return str(exc)
    if not kernel.available():
        return "the CPU (or the compiler) has no AMX-BF16 tiles, or the OS does not grant them"
    return None


def int8_obstacle() -> str | None:
    """Why the int8 kernel cannot run here, or None."""
    try:
        kernel = load_int8_kernel()
    except KernelUnavailable as exc:
        return str(exc)
    if not kernel.available():
        return "the CPU (or the compiler) has neither AVX2 with FMA and F16C nor AVX-512 VNNI"
    return None


def int8_only_formats(formats: Iterable[GGMLQuantizationType]) -> list[str]:
    """The names of `formats` that only the int8 kernel reads, sorted."""
    kept = {effective_format(qtype) for qtype in formats}  # as loaded (`gguf_transcode`)
    return sorted({qtype.name for qtype in kept if is_supported_type(qtype) and not float_kernels_read(qtype)})


def choose_cpu_matmul(
    requested: str, *, speculative: bool = True, formats: Iterable[GGMLQuantizationType] = ()
) -> MatmulChoice:
    """The products kernel for quantized matrices on the CPU (see the module docstring); `speculative`: whether the
    engine verifies drafts (several rows per forward) or decodes one row per step; `formats`: those of the model's
    quantized matrices."""
    if requested not in CPU_MATMUL_OPTIONS:
        raise ModelLoadError(f"unknown --cpu-matmul {requested!r}; choose one of {', '.join(CPU_MATMUL_OPTIONS)}")
    int8_only = int8_only_formats(formats)
    if int8_only:
        return _int8_only_choice(requested, int8_only)
    if requested == "float32":
        return MatmulChoice("float32", "float32 products requested")
    if requested == "amx":
        obstacle = amx_obstacle()
        if obstacle is not None:
            raise ModelLoadError(f"--cpu-matmul amx is not available: {obstacle}")
        return MatmulChoice("amx", "AMX products requested")
    if requested in ("int8", "int8x2"):
        int8 = int8_obstacle()
        if int8 is not None:
            raise ModelLoadError(f"--cpu-matmul {requested} is not available: {int8}")
        return MatmulChoice(requested, f"{requested} products requested")
    obstacle = amx_obstacle()
    if obstacle is None and speculative:
        return MatmulChoice("amx", "auto: the CPU has AMX-BF16 tiles, on which verified rows cost about one")
    int8 = int8_obstacle()
    if int8 is None:
        why = "one row per step" if obstacle is None else f"no AMX-BF16 tiles ({obstacle})"
        return MatmulChoice("int8x2", f"auto: {why}: inputs in two 8-bit parts, integer dot products")
    log.info("float32 products for quantized matrices: %s; %s", obstacle, int8)
    return MatmulChoice("float32", f"auto: {obstacle}; {int8}")


def _int8_only_choice(requested: str, int8_only: list[str]) -> MatmulChoice:
    """The choice for a model with matrices in formats only the int8 kernel reads (`int8_only`)."""
    named = ", ".join(int8_only)
    if requested in ("float32", "amx"):
        raise ModelLoadError(
            f"--cpu-matmul {requested} reads Q4_1 and Q8_0 matrices only; this model has {named} matrices: "
            "use --cpu-matmul int8x2 (or int8, auto), or --weights dense"
        )
    int8 = int8_obstacle()
    if int8 is not None:
        raise ModelLoadError(f"the model's {named} matrices need the int8 kernel, which is not available: {int8}")
    if requested == "auto":
        return MatmulChoice(
            "int8x2", f"auto: {named} matrices, which only the int8 kernel reads: inputs in two 8-bit parts"
        )
    return MatmulChoice(requested, f"{requested} products requested")


def draft_products(kind: str) -> str:
    """The products of a drafter beside a target on `kind`: int8x2 becomes int8 (one 8-bit part per input). Drafts
    are only proposals, verified at the target's own precision, so the drafter's rounding changes no output; one
    part costs less per row, and a drafter's block is 16 rows (its round 0.84x the time on an AVX-512 CPU, the same
    acceptance: `results/cpu_drafter_products_epyc_avx512.json`)."""
    return "int8" if kind == "int8x2" else kind


def tile_products(kind: str) -> bool:
    """Whether verified rows run on AMX tiles under `kind` (amx, or int8 on a CPU with AMX-INT8): several rows
    then cost about one, and the CPU's larger tree budget applies."""
    return kind == "amx" or (kind in ("int8", "int8x2") and load_int8_kernel().has_tiles())


def use_cpu_matmul(model: nn.Module, kind: str) -> int:
    """Put every quantized matrix of `model` on the `kind` kernel; returns how many there are. A table tied to a
    head (the same blocks) then reads the head's, in the layout the kernel keeps them (`share_table`)."""
    matrices = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    tables = {m.blocks.data_ptr(): m for m in model.modules() if isinstance(m, QuantizedEmbedding)}
    for matrix in matrices:
        tied = tables.get(matrix.blocks.data_ptr())
        matrix.use_products(kind)
        if tied is not None:
            tied.share_table(matrix)
    return len(matrices)
