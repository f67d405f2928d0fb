"""Weight panels (`kernels/int8_panels.h`): the int8 kernel's interleaved layout of Q4_0 / Q4_1 / Q8_0 matrices on
the AVX-512 VNNI vector path (the 256-bit builds keep GGUF rows: panels gain nothing there). Panel products are bitwise the GGUF-row products (any rows, parts, sizes, threads);
the layout moves bytes only (rows come back exactly); `QuantizedLinear` keeps one layout and switches between them;
a tied table reads the head's panels; `DFLASH_CPU_PANELS=0` keeps GGUF rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn

from dflash.kernels.build import Int8Kernel, load_int8_kernel
from dflash.models import cpu_matmul
from dflash.models.quantized_layers import QuantizedEmbedding, QuantizedLinear
from dflash.models.quantized_weights import QuantizedMatrix
from tests.test_quantized_kernel import quantized_blocks, two_threads  # noqa: F401

Q4_0, Q4_1, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}


def _panels_obstacle() -> str | None:
    if cpu_matmul.int8_obstacle() is not None:
        return "no int8 dot products on this CPU"
    kernel = load_int8_kernel()
    if not kernel.panels_available():
        return f"weight panels need AVX-512 VNNI ({kernel.isa()} here)"
    return None


needs_panels = pytest.mark.skipif(_panels_obstacle() is not None, reason=str(_panels_obstacle()))


@pytest.fixture(scope="module")
def kernel() -> Int8Kernel:
    return load_int8_kernel()


def any_bytes(rows: int, columns: int, qtype: GGMLQuantizationType, seed: int) -> torch.Tensor:
    """Arbitrary block bytes (every nibble and int8 value) with finite fp16 scales: [rows, bytes per row]."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, columns // 32, BLOCK_BYTES[qtype]), dtype=np.uint8)
    scales = 2 if qtype == Q4_1 else 1
    blocks[..., : 2 * scales] = rng.uniform(-0.05, 0.05, (rows, columns // 32, scales)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(blocks.reshape(rows, -1))


@needs_panels
@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0])
def test_rows_come_back_exactly(kernel: Int8Kernel, qtype: GGMLQuantizationType) -> None:
    blocks = any_bytes(37, 96, qtype, seed=1)  # a partial last group, an odd number of blocks
    panels = kernel.to_panels(blocks, int(qtype))
    assert panels.shape == (3, 3 * 16 * BLOCK_BYTES[qtype])  # the same bytes per row and block
    assert torch.equal(kernel.panel_rows(panels, int(qtype), torch.arange(37)), blocks)
    ids = torch.tensor([36, 0, 17, 17, 5])
    assert torch.equal(kernel.panel_rows(panels, int(qtype), ids), blocks[ids])
    with pytest.raises(RuntimeError, match="outside the panels"):
        kernel.panel_rows(panels, int(qtype), torch.tensor([48]))


@needs_panels
@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0])
@pytest.mark.parametrize("parts", [1, 2])
def test_products_are_the_rows_products_bitwise(
    kernel: Int8Kernel, qtype: GGMLQuantizationType, parts: int, two_threads: None  # noqa: F811
) -> None:
    for n, k, seed in ((37, 96, 2), (200, 576, 3), (16, 1536, 4)):
        blocks = any_bytes(n, k, qtype, seed) if seed == 2 else torch.from_numpy(quantized_blocks(n, k, qtype, seed))
        panels = kernel.to_panels(blocks, int(qtype))
        for m in (1, 2, 3, 4, 5, 9, 17):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed * 100 + m)) * 3
            x[0, :32] = 0  # an all-zero input block
            want = kernel.matmul(x, blocks, int(qtype), False, parts)  # [m, n]
            got = kernel.panel_matmul(x, panels, int(qtype), n, parts)
            assert torch.equal(got, want), (qtype, n, k, m, parts)
            # a row's product does not depend on the rows beside it
            assert torch.equal(kernel.panel_matmul(x[-1:], panels, int(qtype), n, parts), want[-1:])


@needs_panels
def test_mismatched_panels_are_refused(kernel: Int8Kernel) -> None:
    panels = kernel.to_panels(any_bytes(20, 64, Q4_1, seed=5), int(Q4_1))
    with pytest.raises(RuntimeError, match="do not hold"):
        kernel.panel_matmul(torch.randn(1, 96), panels, int(Q4_1), 20)
    with pytest.raises(RuntimeError, match="do not hold"):
        kernel.panel_matmul(torch.randn(1, 64), panels, int(Q4_1), 40)
    with pytest.raises(RuntimeError, match="no panel layout"):
        kernel.to_panels(torch.zeros(16, 144, dtype=torch.uint8), int(GGMLQuantizationType.Q4_K))


@needs_panels
def test_linear_keeps_one_layout_and_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = torch.from_numpy(quantized_blocks(40, 128, Q4_1, seed=6))
    linear = QuantizedLinear(QuantizedMatrix(blocks.clone(), Q4_1, 128))
    x = torch.randn(3, 128)
    linear.use_products("int8x2")
    assert linear.panels and linear.blocks.shape[0] == 3
    paneled = linear(x)
    assert torch.equal(linear.row_blocks(), blocks)
    assert torch.equal(linear.row_blocks(torch.tensor([39, 2])), blocks[[39, 2]])
    linear.use_products("float32")  # the float32 kernel reads GGUF rows: they come back
    assert not linear.panels and torch.equal(linear.blocks, blocks)
    monkeypatch.setenv("DFLASH_CPU_PANELS", "0")
    linear.use_products("int8x2")
    assert not linear.panels
    assert torch.equal(linear(x), paneled)  # the same values either way


@needs_panels
def test_tied_table_reads_the_head_panels() -> None:
    blocks = torch.from_numpy(quantized_blocks(50, 64, Q8_0, seed=7))
    matrix = QuantizedMatrix(blocks, Q8_0, 64)
    table, head = QuantizedEmbedding(matrix), QuantizedLinear(matrix)
    model = nn.ModuleDict({"embed_tokens": table, "lm_head": head})
    ids = torch.tensor([[0, 49, 16], [3, 3, 31]])
    before = table(ids)
    cpu_matmul.use_cpu_matmul(model, "int8")
    assert head.panels and table.panels
    assert table.blocks is head.blocks  # one copy of the table
    assert torch.equal(table(ids), before)


@pytest.mark.slow
def test_narrower_builds_keep_rows(kernel: Int8Kernel) -> None:
    """A 256-bit build reads GGUF rows (no panel products) but converts layouts alike, so a model's matrices read
    the same bytes whichever build converts them."""
    if _panels_obstacle() is not None:
        pytest.skip(str(_panels_obstacle()))
    narrow = load_int8_kernel(("-mno-avx512f",))
    if narrow.isa() == "none":
        pytest.skip("the compiler builds no 256-bit path here")
    assert not narrow.panels_available()
    blocks = any_bytes(45, 224, Q8_0, seed=8)
    assert torch.equal(narrow.to_panels(blocks, int(Q8_0)), kernel.to_panels(blocks, int(Q8_0)))
    with pytest.raises(RuntimeError, match="panel products need AVX-512 VNNI"):
        narrow.panel_matmul(torch.randn(1, 224), kernel.to_panels(blocks, int(Q8_0)), int(Q8_0), 45)
