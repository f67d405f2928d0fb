"""The GGUF block programs (`dflash.kernels.triton_gguf_matmul`) against the `gguf` package's reference dequantisers:
every stored format, 1 to 64 rows, reductions that are and are not a multiple of the step."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from dflash.kernels.gguf_nibbles import nibble_matrix
from dflash.kernels.gpu_quantized_products import QuantizedPart, quantized_linear
from dflash.kernels.triton_decode import interpreting
from dflash.kernels.triton_gguf_int8 import INTEGER_ROWS
from dflash.kernels.triton_gguf_matmul import (
    FORMATS,
    MAX_ROWS,
    GGUFMatmulConfig,
    gguf_dequantize,
    gguf_matmul,
    gguf_matmul_config,
    gguf_programs_usable,
)

T = GGMLQuantizationType
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(
    not gguf_programs_usable(DEVICE), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)"
)
BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_gguf_matmul.py"
ALL_FORMATS = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
SMALL_BLOCKS = (T.Q4_0, T.Q4_1, T.Q8_0)


def format_blocks(n: int, k: int, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """[n, row bytes] blocks of `qtype`: quantised N(0, 0.05) weights where the `gguf` package quantises the format;
    for the K formats random bytes (every scale, min and quant bit pattern) with fp16 d (and dmin) set to 1e-3..2e-3
    so the weights stay finite and of one magnitude."""
    rng = np.random.default_rng(seed)
    if qtype in SMALL_BLOCKS:
        return quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
    layout = FORMATS[qtype]
    raw = rng.integers(0, 256, (n * k // 256, layout.block_bytes), dtype=np.uint8)
    where, count = (208, 1) if qtype == T.Q6_K else (0, 2)  # Q6_K's d is last; Q4_K/Q5_K start with d, dmin
    scales = rng.uniform(1e-3, 2e-3, (raw.shape[0], count)).astype("<f2")
    raw[:, where : where + 2 * count] = scales.view(np.uint8)
    return raw.reshape(n, -1)


def reduction(qtype: GGMLQuantizationType) -> int:
    """A k that is not a multiple of 256-value steps for the 32-value formats (9 blocks), nor of 512-value steps
    for the K formats (3 super-blocks)."""
    return 288 if qtype in SMALL_BLOCKS else 768


def reference(x: torch.Tensor, blocks: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """x @ dequant(W)^T in float64 from the `gguf` package's dequantiser -> [rows, n]."""
    weight = torch.from_numpy(dequantize(blocks, qtype)).double()
    return x.double().cpu() @ weight.T


@needs_triton
@pytest.mark.parametrize("qtype", ALL_FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_matmul_matches_the_reference_dequantisation(qtype: GGMLQuantizationType, rows: int) -> None:
    """float32 x: the product equals x @ dequant(W)^T up to float32 summation order (relative 1e-5 of the largest
    output), with the shape's own configuration and with a 512-value step (a masked tail for both block sizes);
    40 outputs are not a multiple of any tile."""
    n, k = 40, reduction(qtype)
    blocks = format_blocks(n, k, qtype, seed=rows)
    x = torch.randn((rows, k), generator=torch.Generator().manual_seed(rows))
    expected = reference(x, blocks, qtype)
    device_blocks = torch.from_numpy(blocks).to(DEVICE)
    configs = [gguf_matmul_config(rows, qtype), GGUFMatmulConfig(block_n=16, values_per_step=512, use_dot=rows > 1)]
    for config in configs:
        got = gguf_matmul(x.to(DEVICE), device_blocks, qtype, config).double().cpu()
        scale = expected.abs().max().item()
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale, msg=str(config))


@needs_triton
@pytest.mark.parametrize("qtype", ALL_FORMATS, ids=lambda t: t.name)
def test_dequantize_matches_the_reference(qtype: GGMLQuantizationType) -> None:
    """float32 output: the reference's values (the same float32 operations; a fused multiply-add on a GPU may move
    one by an ulp); bf16 output: those values rounded once. 21 rows: not a multiple of the 16-row tile."""
    n, k = 21, reduction(qtype)
    blocks = format_blocks(n, k, qtype, seed=5)
    expected = torch.from_numpy(dequantize(blocks, qtype))
    device_blocks = torch.from_numpy(blocks).to(DEVICE)
    got = gguf_dequantize(device_blocks, qtype, k, torch.float32).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7 * expected.abs().max().item())
    if interpreting():  # the same operations in numpy: bit for bit
        assert torch.equal(got, expected)
    halves = gguf_dequantize(device_blocks, qtype, k, torch.bfloat16).cpu()
    torch.testing.assert_close(halves, got.bfloat16(), rtol=8e-3, atol=0)


@needs_triton
@pytest.mark.parametrize("as_words", [False, True], ids=["blocks", "words"])
def test_linear_joins_parts_of_different_formats_and_dequantises_past_the_row_limit(as_words: bool) -> None:
    """A fused projection of a Q4_K part and a Q6_K part (a Q4_K_M file's q/k and v): each part's product lands in
    its own columns, through the programs up to 64 rows and the dequantised matrix past them, bias added; the Q4_K
    part as blocks or as words (whose few-row products round the inputs: a looser bound there)."""
    k = 512
    first, second = format_blocks(24, k, T.Q4_K, seed=3), format_blocks(8, k, T.Q6_K, seed=4)
    bias = torch.randn(32)
    first_part: QuantizedPart = (torch.from_numpy(first).to(DEVICE), T.Q4_K)
    if as_words:
        first_part = nibble_matrix(torch.from_numpy(first).to(DEVICE), T.Q4_K, k)
    parts = [first_part, (torch.from_numpy(second).to(DEVICE), T.Q6_K)]
    for rows in (1, 5, MAX_ROWS + 6):
        x = torch.randn((rows, k), generator=torch.Generator().manual_seed(rows))
        expected = torch.cat([reference(x, first, T.Q4_K), reference(x, second, T.Q6_K)], dim=1) + bias.double()
        got = quantized_linear(x.to(DEVICE), parts, bias.to(DEVICE)).double().cpu()
        bound = 3e-4 if as_words and rows <= INTEGER_ROWS else 1e-5
        torch.testing.assert_close(got, expected, rtol=0, atol=bound * expected.abs().max().item())
    assert quantized_linear(torch.zeros((0, k), device=DEVICE), parts).shape == (0, 32)


@needs_triton
def test_wrong_operands_are_refused() -> None:
    blocks = torch.from_numpy(format_blocks(8, 256, T.Q4_K, seed=0)).to(DEVICE)
    x = torch.randn((2, 256), device=DEVICE)
    with pytest.raises(ValueError, match="does not serve 2 rows"):
        gguf_matmul(x, blocks, T.Q4_K, GGUFMatmulConfig(use_dot=False))
    with pytest.raises(ValueError, match="does not serve 65 rows"):
        gguf_matmul(torch.randn((65, 256), device=DEVICE), blocks, T.Q4_K)
    with pytest.raises(ValueError, match=r"uint8 \[n, 288\]"):
        gguf_matmul(torch.randn((2, 512), device=DEVICE), blocks, T.Q4_K)
    with pytest.raises(ValueError, match="whole Q4_K blocks"):
        gguf_matmul(torch.randn((2, 128), device=DEVICE), blocks, T.Q4_K)
    with pytest.raises(ValueError, match="do not read Q2_K"):
        gguf_matmul(x, blocks, T.Q2_K)
    with pytest.raises(ValueError, match=r"out must be torch.float32 \[2, 8\]"):
        gguf_matmul(x, blocks, T.Q4_K, out=torch.empty((2, 9), device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", ALL_FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 16, 64])
def test_bf16_products_on_the_gpu(qtype: GGMLQuantizationType, rows: int) -> None:
    """bf16 x on the device at a model's width: within bf16 rounding of the float64 reference (the tile is rounded
    to bf16 before the tensor-core product, as a dense bf16 matrix would be)."""
    n, k = 1024, 4096
    blocks = format_blocks(n, k, qtype, seed=rows)
    x = torch.randn((rows, k), generator=torch.Generator().manual_seed(rows)).bfloat16()
    expected = reference(x.float(), blocks, qtype)
    got = gguf_matmul(x.cuda(), torch.from_numpy(blocks).cuda(), qtype).double().cpu()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-2 * expected.abs().max().item())
    dense = F.linear(x.cuda(), gguf_dequantize(torch.from_numpy(blocks).cuda(), qtype, k)).double().cpu()
    torch.testing.assert_close(got, dense, rtol=0, atol=1e-2 * expected.abs().max().item())


@pytest.mark.skipif(not (interpreting() and gguf_programs_usable(DEVICE)), reason="the dry run is for Triton's interpreter")
def test_benchmark_dry_run_writes_its_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/gpu_gguf_matmul.py --dry-run: tiny shapes on the CPU, every (format, kind, rows) entry checked
    against the dequantised product and reported with its bytes and the dense baseline."""
    monkeypatch.syspath_prepend(str(BENCHMARK.parent))  # it imports a sibling benchmark, as when run as a script
    spec = importlib.util.spec_from_file_location("gpu_gguf_matmul", BENCHMARK)
    assert spec is not None and spec.loader is not None
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    out = tmp_path / "report.json"
    benchmark.main(["--dry-run", "--formats", "Q6_K,Q4_0", "--rows", "1,3", "--grid", "--out", str(out)])
    report = json.loads(out.read_text())
    assert {"device", "versions", "date", "command", "copy_GBps_read_plus_written"} <= set(report)
    assert set(report["results"]) == {f"tiny/{f}/{k}" for f in ("Q6_K", "Q4_0") for k in ("qkv", "down")}
    down = report["results"]["tiny/Q6_K/down"]
    assert down["quantized_bytes"] == 64 * 768 // 256 * 210 and down["dense_bytes"] == 2 * 64 * 768
    for rows in ("rows1", "rows3"):
        chosen = down[rows]["chosen"]
        assert chosen["relative_error"] < 1e-5 and chosen["ms"] > 0 and down[rows]["dense_bf16_ms"] > 0
        assert len(down[rows]["grid"]) > 1


def test_config_by_rows_and_shape() -> None:
    """One row multiplies and sums; more rows go through tensor cores, in wider tiles for wide matrices."""
    assert gguf_matmul_config(1, T.Q4_K, 4096) == GGUFMatmulConfig(8, 512, 4, 2, False)
    assert gguf_matmul_config(16, T.Q8_0, 4096) == GGUFMatmulConfig(32, 512, 4, 3, True)
    assert gguf_matmul_config(64, T.Q8_0, 4096) == GGUFMatmulConfig(16, 256, 4, 2, True)
    assert gguf_matmul_config(4, T.Q4_K, 151936) == GGUFMatmulConfig(32, 256, 4, 2, True)
    assert gguf_matmul_config(64, T.Q4_K, 151936) == GGUFMatmulConfig(64, 256, 8, 2, True)
    assert gguf_matmul_config(64, T.Q6_K, 151936) == GGUFMatmulConfig(32, 256, 4, 2, True)
    assert all(gguf_matmul_config(rows, T.Q6_K).use_dot for rows in range(2, MAX_ROWS + 1))
