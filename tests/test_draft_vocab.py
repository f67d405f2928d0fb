"""The drafter's vocabulary shortlist (`dflash.drafter.vocab`): the file, the restricted head (dense and GGUF
blocks), greedy outputs unchanged with linear DFlash and DDTree, `dflash train vocab`, `--draft-vocab`."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash.drafter.loader import load_drafter
from dflash.drafter.model import DFlashDrafter
from dflash.drafter.vocab import DraftHead, most_frequent_tokens, read_draft_vocab, write_draft_vocab
from dflash.engine.loading import LoadOptions, load_engine
from dflash.errors import ModelLoadError
from tests.golden import golden_dir
from tests.spec_helpers import golden_pair, random_prompts, run
from tests.test_fastpath import generate


def test_most_frequent_tokens_ranks_by_count_then_id() -> None:
    ids = most_frequent_tokens(Counter([5, 5, 7, 9, 7, 5, 3, 9]), size=2, always=[1])
    assert ids.tolist() == [1, 5, 7]  # 5 (3x), then 7 and 9 tie (2x): the lower id; 1 always
    assert ids.dtype == torch.int64


def test_draft_vocab_file_round_trip_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "draft_vocab.safetensors"
    write_draft_vocab(torch.tensor([9, 2, 4]), path)
    assert read_draft_vocab(path, vocab_size=10).tolist() == [2, 4, 9]
    with pytest.raises(ModelLoadError, match="below the target's vocabulary"):
        read_draft_vocab(path, vocab_size=9)
    write_draft_vocab(torch.tensor([1, 1, 2]), path)
    with pytest.raises(ModelLoadError, match="distinct"):
        read_draft_vocab(path, vocab_size=10)
    path.write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="cannot read"):
        read_draft_vocab(path, vocab_size=10)


def fresh_golden_drafter() -> DFlashDrafter:
    target, _ = golden_pair()
    return load_drafter(str(golden_dir("dflash-tiny") / "drafter"), target.config)


def test_dense_head_scores_the_list_and_nothing_else() -> None:
    target, _ = golden_pair()
    vocab = target.config.vocab_size
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[: vocab // 3].sort().values
    hidden = torch.randn(5, target.config.hidden_size)
    full = target.project_logits(hidden)  # [5, vocab]
    logits = DraftHead(ids, target)(hidden)
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[ids] = False
    torch.testing.assert_close(logits[:, ids], full[:, ids])
    assert torch.isneginf(logits[:, outside]).all()
    torch.testing.assert_close(DraftHead(torch.arange(vocab), target)(hidden), full)  # whole list: unchanged


def test_quantized_head_rows_equal_the_full_head_bitwise() -> None:
    pytest.importorskip("gguf")
    from dflash.drafter.quantize import q8_0_matrix
    from dflash.kernels.build import KernelUnavailable, load_quant_kernel
    from dflash.models.quantized_layers import QuantizedLinear

    try:
        load_quant_kernel()
    except KernelUnavailable as exc:
        pytest.skip(f"quantized CPU kernel unavailable: {exc}")
    generator = torch.Generator().manual_seed(1)
    head = QuantizedLinear(q8_0_matrix(torch.randn(300, 64, generator=generator)))
    target = SimpleNamespace(config=SimpleNamespace(vocab_size=300, final_logit_softcapping=None), lm_head=head)
    ids = torch.tensor([0, 3, 17, 128, 299])
    hidden = torch.randn(4, 64, generator=generator)
    logits = DraftHead(ids, target)(hidden)
    assert torch.equal(logits[:, ids], head(hidden)[:, ids])
    assert torch.isneginf(logits).sum() == 4 * (300 - 5)


@pytest.mark.parametrize("mode", ["linear", "ddtree:6"])
def test_greedy_output_unchanged_with_a_shortlist(mode: str) -> None:
    """Drafts come only from the list, the target still decides: greedy output equals plain decoding."""
    target, _ = golden_pair()
    drafter = fresh_golden_drafter()
    vocab = target.config.vocab_size
    prompts = random_prompts(3, vocab, seed=31, lengths=(7, 20, 33))
    plain = [generate(target, None, "none", p, 40) for p in prompts]
    drafted_all = [generate(target, drafter, mode, p, 40) for p in prompts]
    keep = torch.tensor(sorted({token for answer in plain for token in answer})[::2])  # half the answers use
    drafter.use_draft_vocab(keep, target)
    assert drafter.draft_head is not None
    drafted_short = [generate(target, drafter, mode, p, 40) for p in prompts]
    assert drafted_all == plain and drafted_short == plain


def test_linear_acceptance_falls_when_the_answer_is_off_the_list() -> None:
    """With the answer's own tokens on the list acceptance is at least what the full vocabulary gives; with none of them
    every draft is rejected (the drafter proposes only listed tokens), so each round commits one token."""
    target, _ = golden_pair()
    drafter = fresh_golden_drafter()
    prompt = random_prompts(1, target.config.vocab_size, seed=5, lengths=(25,))[0]
    tokens, full_stats = run(target, drafter, prompt, 48)
    drafter.use_draft_vocab(torch.tensor(sorted(set(tokens))), target)
    same, listed_stats = run(target, drafter, prompt, 48)
    others = sorted(set(range(target.config.vocab_size)) - set(tokens))
    drafter.use_draft_vocab(torch.tensor(others), target)
    also_same, off_stats = run(target, drafter, prompt, 48)
    assert same == tokens and also_same == tokens
    assert listed_stats.acceptance_length >= full_stats.acceptance_length
    assert off_stats.acceptance_length == 1.0


def test_train_vocab_cli_counts_answer_tokens(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl.gz"
    with gzip.open(data, "wt", encoding="utf-8") as handle:
        for prompt_ids, response_ids in (([1, 2], [7, 7, 8, 2]), ([3], [7, 9, 9, 2])):
            handle.write(json.dumps({"prompt_ids": prompt_ids, "response_ids": response_ids}) + "\n")
    out = tmp_path / "draft_vocab.safetensors"
    done = subprocess.run(
        [sys.executable, "-m", "dflash", "train", "vocab", "--data", str(data), "--size", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert read_draft_vocab(out, vocab_size=10).tolist() == [2, 7, 9]  # 7 (3x), 2 and 9 (2x); prompts not counted
    assert report["tokens"] == 3 and report["answer_tokens"] == 8 and report["coverage"] == pytest.approx(7 / 8)


def test_missing_draft_vocab_file_is_a_clear_error(tmp_path: Path) -> None:
    absent = str(tmp_path / "absent.safetensors")
    with pytest.raises(ModelLoadError, match="no such file"):
        load_engine("default", "default", loading=LoadOptions(device="cpu", draft_vocab=absent))


@pytest.mark.parametrize("mode", ["linear", "ddtree:6"])
def test_static_forward_path_uses_the_shortlist(mode: str) -> None:
    """The graph runner's drafter forward (run without capture here) projects through the shortlist too:
    its drafts and outputs equal the eager loop's with the same list."""
    from tests.test_fastpath import eager_then_static

    target, _ = golden_pair()
    drafter = fresh_golden_drafter()
    prompts = random_prompts(2, target.config.vocab_size, seed=41, lengths=(9, 30))
    plain = [generate(target, None, "none", p, 32) for p in prompts]
    drafter.use_draft_vocab(torch.tensor(sorted({t for answer in plain for t in answer})[1::2]), target)
    eager, static, runner = eager_then_static(target, drafter, mode, prompts, 32, capacity=256)
    assert eager == plain and static == plain and runner.served > 0


def test_default_drafter_on_the_cpu_uses_its_shipped_shortlist() -> None:
    shipped = load_engine("default", loading=LoadOptions(device="cpu"))
    assert shipped.drafter is not None and shipped.drafter.draft_head is not None
    ids = shipped.drafter.draft_head.ids
    assert 4096 < ids.numel() < shipped.target.config.vocab_size and 2 in ids.tolist()  # <|im_end|> is listed
    whole = load_engine("default", loading=LoadOptions(device="cpu", draft_vocab="off"))
    assert whole.drafter is not None and whole.drafter.draft_head is None
