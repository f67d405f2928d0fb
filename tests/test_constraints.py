"""Token constraints on their own: the token table of real vocabularies, the one-of (tool name) masks on the
SmolLM2 tokenizer, the per-row masks of draft paths and trees, and how `TokenChooser` applies them."""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dflash.generation.constraints import OneOfConstraint, row_masks
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser
from dflash.generation.token_table import TokenTable
from dflash.models.gguf_file import GGUFFile
from dflash.tokenizer import Tokenizer
from tests.loading_helpers import smollm2_path

NAMES = ("get_weather", "get_time", "search")


@cache
def smollm() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(smollm2_path()).metadata, source="smollm2")


@cache
def smollm_table() -> TokenTable:
    return TokenTable.from_tokenizer(smollm().backend, 49152)


def tok(piece: str) -> int:
    token = smollm().token_to_id(piece)
    assert token is not None, piece
    return token


def allowed_pieces(mask: torch.Tensor) -> set[str]:
    return {smollm().backend.id_to_token(int(i)) for i in mask.nonzero().squeeze(-1)}


def json_names() -> OneOfConstraint:
    return OneOfConstraint(smollm_table(), [f'{n}"'.encode() for n in NAMES])


# ---- token table -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    'Hello wörld 😀 {"name": "get_weather"}\n\tdef f():  return 1',
    "naïve café, 日本語 12345",
])
def test_table_bytes_rebuild_the_decoded_text(text: str) -> None:
    ids = smollm().encode(text)
    table = smollm_table()
    assert b"".join(table.bytes_of[i] or b"" for i in ids).decode() == smollm().decode(ids) == text


def test_table_special_tokens_write_nothing() -> None:
    table = smollm_table()
    for special in ("<|im_end|>", "<|im_start|>", "<|endoftext|>"):
        assert table.bytes_of[tok(special)] is None
    assert table.bytes_of[tok("Ġ")] == b" " and table.bytes_of[tok("Ċ")] == b"\n"
    assert tok('",') in table.starting_with(b'"') and tok('",') not in table.exactly(b'"')


def test_table_of_a_sentencepiece_vocabulary() -> None:
    """`▁` is a space, `<0xNN>` is the byte NN, control tokens write nothing."""
    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "▁get", "_", "weather", "▁", "get"]
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.token_type": [2, 3, 3, *[6] * 256, 1, 1, 1, 1, 1],
        "tokenizer.ggml.scores": [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    tokenizer = Tokenizer.from_gguf_metadata(md, source="spm")
    table = TokenTable.from_tokenizer(tokenizer.backend)
    assert table.bytes_of[1] is None and table.bytes_of[2] is None
    assert table.bytes_of[3 + 0xC3] == b"\xc3"
    assert table.bytes_of[259] == b" get" and table.bytes_of[262] == b" "
    ids = tokenizer.encode("x get_weather é")
    # the tokens' own bytes keep the space the encoder put in front (the decoder strips it from a whole text)
    assert b"".join(table.bytes_of[i] or b"" for i in ids) == " x get_weather é".encode()


# ---- one-of masks on the SmolLM2 vocabulary --------------------------------------------------------------------

def test_first_mask_holds_exactly_the_prefixes_of_the_names() -> None:
    allowed = allowed_pieces(json_names().start().allowed())
    assert {"g", "ge", "get", "s", "se", "search"} <= allowed
    for piece in allowed:  # nothing that leaves the names
        assert any(f'{n}"'.startswith(piece) or piece.startswith(f'{n}"') for n in NAMES), piece
    assert "Paris" not in allowed and "<|im_end|>" not in allowed and "Ġget" not in allowed


def test_mask_after_a_shared_prefix_and_tokens_running_past_the_name() -> None:
    state = json_names().start()
    assert state.advance(tok("get")) and state.advance(tok("_"))
    assert allowed_pieces(state.allowed()) >= {"weather", "time", "w", "t"}
    assert "search" not in allowed_pieces(state.allowed())
    assert state.advance(tok("weather")) and not state.finished
    after_name = allowed_pieces(state.allowed())
    assert {'"', '",', '":', '"}'} <= after_name  # the closing quote, alone or with what follows it
    assert all(p.startswith('"') for p in after_name)
    assert not state.advance(tok("s"))  # refused: the state does not move
    assert state.advance(tok('",')) and state.finished


def test_a_token_spanning_the_whole_rest_of_a_name() -> None:
    table = TokenTable([b"get", b"_weather", b'_weather",', b"x", b'"'])
    state = OneOfConstraint(table, [b'get_weather"']).start()
    assert state.allowed().tolist() == [True, False, False, False, False]
    state.advance(0)
    assert state.allowed().tolist() == [False, True, True, False, False]
    assert state.advance(2) and state.finished


def test_rollback_restores_the_state() -> None:
    state = json_names().start()
    before = state.allowed().clone()
    assert state.advance(tok("search")) and state.advance(tok('",'))
    assert state.finished
    state.rollback(2)
    assert not state.finished and torch.equal(state.allowed(), before)


# ---- masks of draft paths and trees ----------------------------------------------------------------------------

def letters(options: list[bytes]) -> tuple[OneOfConstraint, dict[str, int]]:
    """Tokens 0-5 write a-f, token 6 `"`; returns the constraint and a letter -> token map."""
    table = TokenTable([*(bytes([97 + i]) for i in range(6)), b'"'])
    return OneOfConstraint(table, options), {chr(97 + i): i for i in range(6)} | {'"': 6}


def allowed_sets(masks: torch.Tensor) -> list[set[int]]:
    return [set(row.nonzero().squeeze(-1).tolist()) for row in masks]


def test_chain_rows_follow_the_draft_and_leave_the_state_as_it_was() -> None:
    constraint, t = letters([b'abc"', b'abd"', b'bee"'])
    state = constraint.start()
    masks = row_masks(state, [t["a"], t["b"], t["c"], t['"'], t["a"]], None, 9)
    assert masks.shape == (6, 9)
    assert allowed_sets(masks) == [{0, 1}, {1}, {2, 3}, {6}, set(range(9)), set(range(9))]
    assert state.written == b"" and allowed_sets(state.allowed()[None]) == [{0, 1}]


def test_rows_below_a_forbidden_draft_are_free() -> None:
    constraint, t = letters([b'abc"'])
    masks = row_masks(constraint.start(), [t["a"], t["e"], t["c"]], None, 7)
    assert allowed_sets(masks)[:2] == [{0}, {1}]
    assert masks[2:].all()  # never committed from: the choice at row 1 cannot be "e"


def test_tree_rows_follow_each_nodes_path_even_when_nodes_interleave() -> None:
    """Nodes in heap order: a later node's parent may be off the path the walk is on."""
    constraint, t = letters([b'abc"', b'ad"', b'be"'])
    # node: 1 a (root), 2 b (root), 3 b (1), 4 e (2), 5 d (1), 6 c (3), 7 f (1: forbidden), 8 a (7)
    drafts = [t["a"], t["b"], t["b"], t["e"], t["d"], t["c"], t["f"], t["a"]]
    parents = [-1, 0, 0, 1, 2, 1, 3, 1, 7]
    masks = row_masks(constraint.start(), drafts, parents, 7)
    sets = allowed_sets(masks)
    assert sets[0] == {0, 1}  # a | b
    assert sets[1] == {1, 3}  # after a: b | d
    assert sets[2] == {4}  # after b: e
    assert sets[3] == {2}  # after ab: c
    assert sets[4] == {6}  # after be: "
    assert sets[5] == {6}  # after ad: "
    assert sets[6] == {6}  # after abc: "
    assert masks[7].all() and masks[8].all()  # below the forbidden f


# ---- the chooser -----------------------------------------------------------------------------------------------

def chooser_with(state: Any, *, min_tokens: int = 0, eos: tuple[int, ...] = (), vocab: int = 7) -> TokenChooser:
    return TokenChooser(SamplingParams(), eos_ids=eos, min_tokens=min_tokens, vocab_size=vocab, device="cpu",
                        constraint=state)


def test_chooser_takes_the_best_allowed_token_and_drops_a_finished_constraint() -> None:
    constraint, t = letters([b'ab"'])
    chooser = chooser_with(constraint.start())
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    assert chooser.choose(logits, 0).tolist() == [t["a"]]  # not the best token (6)
    chooser.observe([t["a"], t["b"]])
    assert chooser.constrained
    chooser.observe([t['"']])
    assert not chooser.constrained  # finished: the next choice is unrestricted
    assert chooser.choose(logits, 3).tolist() == [6]


def test_chooser_rows_use_their_masks() -> None:
    constraint, t = letters([b'ab"', b'ad"'])
    chooser = chooser_with(constraint.start())
    allowed = chooser.allowed([t["a"], t["d"]])
    assert allowed is not None
    logits = torch.arange(7.0).repeat(3, 1)
    assert chooser.choose(logits, 0, allowed).tolist() == [t["a"], t["d"], t['"']]


def test_a_constraint_that_allows_only_eos_outranks_min_tokens() -> None:
    state = SimpleNamespace(
        finished=False, allowed=lambda: torch.tensor([False, False, True]), rollback=lambda count: None
    )
    chooser = TokenChooser(SamplingParams(), eos_ids=(2,), min_tokens=5, vocab_size=3, device="cpu",
                           constraint=state)  # type: ignore[arg-type]
    assert chooser.choose(torch.tensor([[3.0, 2.0, 1.0]]), 0).tolist() == [2]  # token 2 is EOS


def test_resident_rounds_decline_while_a_constraint_is_active() -> None:
    from dflash.fastpath.resident import ResidentDecoder

    constraint, _ = letters([b'ab"'])
    chooser = chooser_with(constraint.start())
    sink = SimpleNamespace(token_ids=[])
    fake = SimpleNamespace(fits=lambda *args: True)  # would serve the rounds if the constraint were ignored
    taken = ResidentDecoder.take_over(fake, None, None, 100, sink, chooser, None)  # type: ignore[arg-type]
    assert taken is False
