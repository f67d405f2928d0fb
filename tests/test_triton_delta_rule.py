"""The gated delta rule's row program (`dflash.kernels.triton_delta_rule`) against the torch forms, and a hybrid
model decoding through it: tree rows, replays and one-token steps reach bitwise the states a linear pass reaches,
so speculative greedy tokens stay the plain ones."""

from __future__ import annotations

import pytest
import torch

from dflash.kernels import triton_delta_rule
from dflash.kernels.triton_delta_rule import delta_rule_program_usable, delta_rule_rows
from dflash.models.delta_rule import recurrent_delta_rule, tree_delta_rule
from dflash.models.model import CausalLM
from tests.test_hybrid_spec import _path

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_program = pytest.mark.skipif(
    not delta_rule_program_usable(torch.empty(0, device=DEVICE)), reason="needs Triton (a GPU, or TRITON_INTERPRET=1)"
)


def _rows(batch: int, heads: int, rows: int, key_dim: int, value_dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(q, k, v, g, beta, state) as a Gated DeltaNet layer feeds them: unit keys, log decays <= 0."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, rows, key_dim, generator=generator) * key_dim**-0.5
    k = torch.nn.functional.normalize(torch.randn(batch, heads, rows, key_dim, generator=generator), dim=-1)
    v = torch.randn(batch, heads, rows, value_dim, generator=generator)
    g = -torch.rand(batch, heads, rows, generator=generator) * 0.5
    beta = torch.rand(batch, heads, rows, generator=generator)
    state = torch.randn(batch, heads, key_dim, value_dim, generator=generator)
    return tuple(t.to(DEVICE) for t in (q, k, v, g, beta, state))


def _ancestors(parents: list[int]) -> torch.Tensor:
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for row, parent in enumerate(parents):
        mask[row, row] = True
        while parent >= 0:
            mask[row, parent] = True
            parent = parents[parent]
    return mask.to(DEVICE)


@needs_program
@pytest.mark.parametrize(("rows", "key_dim", "value_dim"), [(1, 8, 12), (7, 16, 40), (20, 32, 32)])
def test_a_chain_gives_the_torch_rule_s_outputs_and_state(rows: int, key_dim: int, value_dim: int) -> None:
    q, k, v, g, beta, state = _rows(2, 3, rows, key_dim, value_dim, seed=rows)
    out, final = delta_rule_rows(q, k, v, g, beta, state)
    expected_out, expected_state = recurrent_delta_rule(q, k, v, g, beta, state)
    assert out is not None and final is not None
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, expected_state, rtol=1e-5, atol=1e-5)


@needs_program
def test_tree_rows_are_chains_along_their_paths_bit_for_bit() -> None:
    """Each tree row's output equals the torch tree rule's, and bitwise the last output of a chain over its own
    path; a replay (no read-out) of a path, in place into the state, gives bitwise that chain's final state."""
    parents = [-1, 0, 0, 1, 2, 2, 5, 3, -1, 8]  # branches, a second root, paths longer than a convolution
    q, k, v, g, beta, state = _rows(2, 2, len(parents), 16, 24, seed=5)
    out, final = delta_rule_rows(q, k, v, g, beta, state, ancestors=_ancestors(parents))
    assert out is not None and final is None
    torch.testing.assert_close(out, tree_delta_rule(q, k, v, g, beta, state, parents), rtol=1e-5, atol=1e-5)
    for node in range(len(parents)):
        path = torch.tensor(_path(parents, node), device=DEVICE)
        picked = [t.index_select(2, path) for t in (q, k, v, g, beta)]
        chain_out, chain_state = delta_rule_rows(*picked, state)
        assert chain_out is not None and chain_state is not None
        assert torch.equal(out[:, :, node], chain_out[:, :, -1]), f"row {node}"
        in_place = state.clone()
        delta_rule_rows(None, *picked[1:], in_place, final=in_place)
        assert torch.equal(in_place, chain_state), f"replay of row {node}"


@needs_program
def test_one_row_at_a_time_reaches_a_chain_s_state_bit_for_bit() -> None:
    """Plain decoding (a row per call) and a verification (all rows in one call) leave the same state."""
    q, k, v, g, beta, state = _rows(1, 4, 6, 16, 16, seed=9)
    _, chain = delta_rule_rows(q, k, v, g, beta, state)
    stepped: torch.Tensor | None = state
    for row in range(6):
        assert stepped is not None
        one = [t[:, :, row : row + 1] for t in (q, k, v, g, beta)]
        _, stepped = delta_rule_rows(*one, stepped)
    assert chain is not None and stepped is not None and torch.equal(chain, stepped)


@needs_program
def test_a_counted_chain_stops_at_its_live_rows() -> None:
    """A graph padded past its live rows: the final state is the one after the live rows, the padding rows'
    outputs stay zero."""
    q, k, v, g, beta, state = _rows(1, 2, 8, 8, 8, seed=3)
    count = torch.tensor([5], device=DEVICE)
    out, final = delta_rule_rows(q, k, v, g, beta, state, count=count)
    live = [t[:, :, :5] for t in (q, k, v, g, beta)]
    expected_out, expected_state = delta_rule_rows(*live, state)
    assert out is not None and expected_out is not None and final is not None and expected_state is not None
    assert torch.equal(final, expected_state) and torch.equal(out[:, :, :5], expected_out)
    assert not out[:, :, 5:].any()


@needs_program
def test_a_hybrid_decodes_through_the_program_losslessly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny hybrid with its steps, verifications, trees and rollbacks through the program (interpreted on the
    CPU): linear DFlash and DDTree give plain decoding's greedy tokens, and the program did serve."""
    from tests.family_checks import check_linear_and_ddtree_equal_plain
    from tests.hybrid_models import hf_tiny_hybrid, ours_from_hf_hybrid
    from tests.test_hybrid_spec import _drafter

    calls = 0
    original = triton_delta_rule.delta_rule_rows

    def counted(*args: object, **kwargs: object) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_delta_rule, "SERVES_INTERPRETED", True)
    monkeypatch.setattr("dflash.models.gated_deltanet.delta_rule_rows", counted)
    monkeypatch.setattr("dflash.kv.recurrent.delta_rule_rows", counted)
    target: CausalLM = ours_from_hf_hybrid(hf_tiny_hybrid(seed=11)).to(DEVICE)
    check_linear_and_ddtree_equal_plain(monkeypatch, target, _drafter().to(DEVICE), 12)
    assert calls > 0
