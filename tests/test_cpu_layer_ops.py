"""The fused CPU layer operations (`kernels/cpu_layer_ops.cpp`) against the torch operations they replace, row
invariance (a row computed among others is bitwise the row computed alone), and the switch back to torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash.kernels import fused_cpu
from dflash.kernels.build import KernelUnavailable, LayerOpsKernel, load_layer_ops
from dflash.models.layers import GatedMLP, RMSNorm
from dflash.models.rope import apply_rotary


@pytest.fixture(scope="module")
def ops() -> LayerOpsKernel:
    try:
        return load_layer_ops()
    except KernelUnavailable as exc:  # pragma: no cover - machines without a compiler
        pytest.skip(str(exc))


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, adds_one: bool) -> torch.Tensor:
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed * (1.0 + weight) if adds_one else weight * normed


def torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("adds_one", [False, True])
def test_rms_norm_matches_torch(ops: LayerOpsKernel, adds_one: bool) -> None:
    torch.manual_seed(0)
    x, weight = torch.randn(2, 7, 576) * 3, torch.randn(576)
    got = ops.rms_norm(x, weight, 1e-5, adds_one)
    torch.testing.assert_close(got, torch_rms_norm(x, weight, 1e-5, adds_one), rtol=1e-5, atol=1e-5)
    strided = torch.randn(3, 5, 9, 64).transpose(1, 2)  # per-head norms take non-contiguous views
    torch.testing.assert_close(
        ops.rms_norm(strided, weight[:64], 1e-6, adds_one), torch_rms_norm(strided, weight[:64], 1e-6, adds_one),
        rtol=1e-5, atol=1e-5,
    )


def test_rotary_is_bitwise_the_torch_formula(ops: LayerOpsKernel) -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 6, 9, 64).transpose(1, 2)  # [batch, heads, seq, head_dim] view, as the layers pass it
    for cos_batch in (1, 2):
        cos, sin = torch.randn(cos_batch, 1, 6, 64), torch.randn(cos_batch, 1, 6, 64)
        assert torch.equal(ops.rotary(x, cos, sin), torch_rotary(x, cos, sin))


@pytest.mark.parametrize("head_dim", [64, 128, 48])  # 64 and 128 have a vector path of their own
@pytest.mark.parametrize("rows,keys,masked", [(1, 37, False), (5, 300, True), (16, 130, True), (3, 8, False)])
def test_attention_matches_sdpa(ops: LayerOpsKernel, rows: int, keys: int, masked: bool, head_dim: int) -> None:
    torch.manual_seed(rows)
    q = torch.randn(2, rows, 9, head_dim).transpose(1, 2)  # [batch, heads, rows, head_dim]
    storage_k = torch.randn(2, 3, keys + 10, head_dim)
    storage_v = torch.randn(2, 3, keys + 10, head_dim)
    k, v = storage_k[:, :, :keys], storage_v[:, :, :keys]  # cache views: strided over heads
    mask = None
    if masked:
        mask = torch.rand(2, 1, rows, keys) > 0.4
        mask[..., 0] = True  # every row sees a key
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)  # float32 reference
    got = ops.attention(q, k, v, mask, 0.125)  # [batch, rows, heads * head_dim]
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(2, rows, -1), rtol=1e-5, atol=1e-5)


def test_silu_mul_matches_torch(ops: LayerOpsKernel) -> None:
    torch.manual_seed(2)
    gate_up = torch.randn(3, 4, 2 * 100) * 8  # wide range: exp saturates at both ends
    gate_up[0, 0, 0], gate_up[0, 0, 1] = -120.0, 95.0
    want = F.silu(gate_up[..., :100]) * gate_up[..., 100:]
    torch.testing.assert_close(ops.silu_mul(gate_up), want, rtol=2e-6, atol=1e-6)


def test_every_row_is_bitwise_the_row_computed_alone(ops: LayerOpsKernel) -> None:
    """The verification rows of speculative decoding must equal the same rows decoded one at a time."""
    torch.manual_seed(3)
    rows, keys = 7, 50
    x, weight = torch.randn(1, rows, 576), torch.randn(576)
    q = torch.randn(1, 9, rows, 64)
    k, v = torch.randn(1, 3, keys, 64), torch.randn(1, 3, keys, 64)
    mask = torch.ones(1, 1, rows, keys, dtype=torch.bool).tril(keys - rows)  # causal over the new rows
    cos, sin = torch.randn(1, 1, rows, 64), torch.randn(1, 1, rows, 64)
    gate_up = torch.randn(1, rows, 2 * 96)
    norm_all = ops.rms_norm(x, weight, 1e-5, False)
    rot_all = ops.rotary(q, cos, sin)
    attn_all = ops.attention(q, k, v, mask, 0.125)
    silu_all = ops.silu_mul(gate_up)
    for r in range(rows):
        one = slice(r, r + 1)
        assert torch.equal(ops.rms_norm(x[:, one], weight, 1e-5, False), norm_all[:, one])
        assert torch.equal(ops.rotary(q[:, :, one], cos[:, :, one], sin[:, :, one]), rot_all[:, :, one])
        assert torch.equal(ops.attention(q[:, :, one], k, v, mask[:, :, one], 0.125), attn_all[:, one])
        assert torch.equal(ops.silu_mul(gate_up[:, one]), silu_all[:, one])


def test_verified_rows_equal_steps_over_their_own_keys(ops: LayerOpsKernel) -> None:
    """As in decoding: a plain step of row r sees only the keys up to its own position (no mask, a cache of
    `past + r + 1` keys), while the verification of all rows holds every key and masks the later ones. Key counts
    that are not multiples of the kernels' vector widths once made the exponentials differ in the last bits."""
    torch.manual_seed(5)
    rows = 9
    for past in (29, 64, 130, 133):
        keys = past + rows
        q = torch.randn(1, 9, rows, 64)
        k, v = torch.randn(1, 3, keys, 64), torch.randn(1, 3, keys, 64)
        mask = torch.ones(1, 1, rows, keys, dtype=torch.bool).tril(past)
        together = ops.attention(q, k, v, mask, 0.125)  # [1, rows, 9 * 64]
        for r in range(rows):
            seen = past + r + 1
            alone = ops.attention(q[:, :, r : r + 1], k[:, :, :seen], v[:, :, :seen], None, 0.125)
            assert torch.equal(alone, together[:, r : r + 1]), (past, r)


def test_layers_use_the_kernel_only_without_autograd(ops: LayerOpsKernel) -> None:
    torch.manual_seed(4)
    norm, mlp = RMSNorm(64, 1e-6), GatedMLP(64, 48, "silu")
    x = torch.randn(1, 3, 64)
    with torch.no_grad():
        assert fused_cpu.layer_ops(x) is ops
        fused = norm(x), mlp(x)
    with torch.enable_grad():
        assert fused_cpu.layer_ops(x) is None  # training keeps the differentiable torch path
        reference = norm(x), mlp(x)
        assert reference[0].requires_grad
    torch.testing.assert_close(fused[0], reference[0].detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused[1], reference[1].detach(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert fused_cpu.layer_ops(x.double()) is None
        q, cos = torch.randn(1, 2, 3, 64), torch.randn(1, 1, 3, 64)
        assert torch.equal(apply_rotary(q, cos, cos), torch_rotary(q, cos, cos))


def test_a_failed_build_falls_back_to_torch_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def no_compiler() -> LayerOpsKernel:
        calls.append(1)
        raise KernelUnavailable("building the kernel cpu_layer_ops.cpp failed: g++: not found")

    monkeypatch.setattr(fused_cpu, "load_layer_ops", no_compiler)
    monkeypatch.setattr(fused_cpu, "_kernel", None)
    monkeypatch.setattr(fused_cpu, "_unavailable", False)
    x = torch.randn(1, 2, 64)
    with torch.no_grad(), caplog.at_level("WARNING", "dflash.kernels.fused_cpu"):
        assert fused_cpu.layer_ops(x) is None
        assert fused_cpu.layer_ops(x) is None
        out = RMSNorm(64, 1e-6)(x)
    assert calls == [1]
    assert any("g++: not found" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(out, torch_rms_norm(x, torch.ones(64), 1e-6, False))


def test_the_environment_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_cpu, "_kernel", None)
    monkeypatch.setattr(fused_cpu, "_unavailable", False)
    monkeypatch.setenv("DFLASH_CPU_LAYER_OPS", "0")
    with torch.no_grad():
        assert fused_cpu.layer_ops(torch.randn(2, 8)) is None


@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_tree_rows_equal_steps_over_their_compacted_paths(ops: LayerOpsKernel, head_dim: int) -> None:
    """A DDTree verification row sees the committed keys plus its ancestors at scattered slots of the tree block
    (other nodes masked between them); once accepted, the same token decoded alone sees those ancestors side by
    side. The kernel's sums must not depend on where the masked keys sit."""
    torch.manual_seed(7)
    parents = [-1, 0, 0, 1, 2, 3, 3, 4, 6, 8, 9, 5, 11, 12, 7, 14]  # a 16-node tree, root first
    nodes = len(parents)
    for past in (30, 77, 200):
        keys = past + nodes
        q = torch.randn(1, 9, nodes, head_dim)
        k, v = torch.randn(1, 3, keys, head_dim), torch.randn(1, 3, keys, head_dim)
        mask = torch.zeros(1, 1, nodes, keys, dtype=torch.bool)
        mask[..., :past] = True
        paths = []
        for node in range(nodes):
            path, at = [], node
            while at >= 0:
                path.append(at)
                at = parents[at]
            paths.append(path[::-1])
            mask[0, 0, node, [past + i for i in path]] = True
        together = ops.attention(q, k, v, mask, 0.125)  # [1, nodes, 9 * head_dim]
        for node, path in enumerate(paths):
            slots = torch.tensor([*range(past), *(past + i for i in path)])
            alone = ops.attention(q[:, :, node : node + 1], k[:, :, slots], v[:, :, slots], None, 0.125)
            assert torch.equal(alone, together[:, node : node + 1]), (past, node)


def test_argmax_rows_is_torch_argmax(ops: LayerOpsKernel) -> None:
    """First index of the maximum (ties, a maximum in the last partial vector), NaN ranked first as torch does."""
    torch.manual_seed(9)
    for vocab in (1, 7, 16, 49152, 49157):
        logits = torch.randn(6, vocab)
        logits[1] = logits[1].round()  # many ties
        logits[2, -1] = 100.0  # the maximum in the tail
        logits[3] = float("-inf")
        logits[4, vocab // 2] = float("nan")
        logits[5, : min(vocab, 3)] = 50.0  # equal maxima, the first wins
        assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1)), vocab
    strided = torch.randn(40, 3)[:, 1:].t()  # [2, 40], not contiguous
    assert torch.equal(ops.argmax_rows(strided), strided.argmax(dim=-1))
