"""The skinny product program (`dflash.kernels.triton_skinny`) against `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.kernels.triton_skinny import SkinnyConfig, fast_linear, skinny_config, skinny_linear
from dflash.kernels.triton_tree import tree_kernel_usable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(not tree_kernel_usable(DEVICE), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)")

CONFIGS = [
    SkinnyConfig(16, 128, 4, 2, True),
    SkinnyConfig(32, 256, 4, 3, True),
    SkinnyConfig(4, 256, 4, 1, False),
    SkinnyConfig(8, 512, 8, 2, False),
]


@needs_triton
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 16, 33])
@pytest.mark.parametrize(("n", "k"), [(40, 512), (70, 576)])
def test_skinny_linear_matches_linear(config: SkinnyConfig, rows: int, n: int, k: int) -> None:
    """float32: equal to F.linear up to summation order, for reductions that are and are not a multiple of the
    step and output widths that are not a multiple of the tile; the one-row path refuses more rows."""
    generator = torch.Generator().manual_seed(rows * 100 + n)
    x = torch.randn((rows, k), generator=generator).to(DEVICE)
    weight = torch.randn((n, k), generator=generator).to(DEVICE)
    if not config.use_dot and rows > 1:
        with pytest.raises(ValueError, match="does not serve"):
            skinny_linear(x, weight, config)
        return
    torch.testing.assert_close(skinny_linear(x, weight, config), F.linear(x, weight), rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("rows", [1, 16, 33])
def test_int8_rows_scale_the_sums(config: SkinnyConfig, rows: int) -> None:
    """int8 weight with one scale per row: equal to F.linear with the widened, scaled matrix up to summation order
    (an output width that is not a multiple of the tile, a reduction that is not a multiple of the step)."""
    generator = torch.Generator().manual_seed(rows)
    n, k = 70, 576
    x = torch.randn((rows, k), generator=generator).to(DEVICE)
    values = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8).to(DEVICE)
    scales = (torch.rand(n, generator=generator) * 0.02 + 1e-3).to(DEVICE)
    expected = F.linear(x, values.float() * scales[:, None])
    if not config.use_dot and rows > 1:
        with pytest.raises(ValueError, match="does not serve"):
            skinny_linear(x, values, config, scales)
        return
    torch.testing.assert_close(skinny_linear(x, values, config, scales), expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="int8 weight"):
        skinny_linear(x, values.float(), config, scales)
    if DEVICE.type == "cuda":  # bf16 activations: the widened tile is exact, the sums float32, one rounding
        half = x.to(torch.bfloat16)
        reference = F.linear(half.float(), values.float() * scales[:, None])
        torch.testing.assert_close(skinny_linear(half, values, config, scales).float(), reference, rtol=1e-2, atol=1e-2)


def test_fast_linear_widens_int8_rows_where_the_program_does_not_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    values = torch.randint(-127, 128, (24, 64), dtype=torch.int8)
    scales, bias = torch.rand(24) / 100, torch.randn(24)
    for rows in (1, 80):
        x = torch.randn(rows, 64)
        expected = F.linear(x, values.float() * scales[:, None], bias)
        torch.testing.assert_close(fast_linear(x, values, bias, scales), expected, rtol=1e-5, atol=1e-5)


def test_skinny_config_by_rows() -> None:
    assert skinny_config(1, 4096) == SkinnyConfig(8, 2048, 16, 2, False)
    assert skinny_config(1, 576) == SkinnyConfig(4, 1024, 8, 2, False)
    assert skinny_config(16, 4096) == SkinnyConfig(32, 512, 4, 4, True)
    assert skinny_config(33, 576) == SkinnyConfig(32, 128, 4, 4, True)
    assert skinny_config(65, 4096) is None
    assert skinny_config(32, 4096, int8=True) == SkinnyConfig(16, 256, 4, 3, True)
    assert skinny_config(16, 4096, int8=True) == skinny_config(16, 4096)


def test_one_row_h200_config_by_shape() -> None:
    """On an H200 one row's configuration follows the matrix's shape (a 32B model's gate/up, down and QKV); a
    narrow reduction and the H100 keep theirs."""
    assert skinny_config(1, 5120, gpu="H200", n=51200) == SkinnyConfig(8, 512, 4, 2, False)
    assert skinny_config(1, 12800, gpu="H200", n=5120) == SkinnyConfig(4, 2048, 4, 1, False)
    assert skinny_config(1, 5120, gpu="H200", n=10240) == SkinnyConfig(4, 1024, 4, 2, False)
    assert skinny_config(1, 576, gpu="H200", n=1536) == skinny_config(1, 576)
    assert skinny_config(1, 12800, n=5120) == SkinnyConfig(8, 2048, 16, 2, False)


def test_fast_linear_keeps_cublas_where_the_program_does_not_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU without the interpreter, past 64 rows, or with DFLASH_PRODUCTS=cublas the result is F.linear's
    own, bit for bit (bias included); a misspelt choice is a clear error."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    weight, bias = torch.randn(24, 64), torch.randn(24)
    for rows in (1, 80):
        x = torch.randn(rows, 64)
        assert torch.equal(fast_linear(x, weight, bias), F.linear(x, weight, bias))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("DFLASH_PRODUCTS", "cublas")
    x = torch.randn(2, 64)
    assert torch.equal(fast_linear(x, weight, bias), F.linear(x, weight, bias))
    monkeypatch.setenv("DFLASH_PRODUCTS", "fast")
    with pytest.raises(ValueError, match="DFLASH_PRODUCTS"):
        fast_linear(x, weight)


@needs_triton
def test_fast_linear_adds_the_bias_through_the_program(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_PRODUCTS", "skinny")
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(7)
    x = torch.randn((5, 256), generator=generator).to(DEVICE, dtype)
    weight = torch.randn((48, 256), generator=generator).to(DEVICE, dtype)
    bias = torch.randn(48, generator=generator).to(DEVICE, dtype)
    expected = F.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(fast_linear(x, weight, bias).float(), expected, rtol=2e-2, atol=2e-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 2, 16, 32, 40, 64])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (960, 576), (576, 1536)])
def test_skinny_linear_bf16_on_the_gpu(rows: int, n: int, k: int) -> None:
    """bf16 on the device with each shape's own configuration: within bf16 rounding of a float32 product."""
    generator = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn((rows, k), generator=generator, device="cuda").bfloat16()
    weight = (torch.randn((n, k), generator=generator, device="cuda") * 0.02).bfloat16()
    config = skinny_config(rows, k)
    assert config is not None
    expected = F.linear(x.float(), weight.float())
    torch.testing.assert_close(skinny_linear(x, weight, config).float(), expected, rtol=1e-2, atol=2e-2)
