"""General-task training requests: reproducible, distinct, mixed across kinds, passages cut from plain texts."""

from __future__ import annotations

from pathlib import Path

from dflash.training.task_prompts import passages_from_files, task_prompts, text_passages

GUTENBERG_LIKE = """Header text of the archive.
*** START OF THE PROJECT GUTENBERG EBOOK SAMPLE ***

ACT I. SCENE 1.

ALPHA.
""" + "Words spoken by Alpha about the harbour and the night. " * 8 + """

BETA.
""" + "Beta answers at length about the ships in the bay. " * 8 + """

*** END OF THE PROJECT GUTENBERG EBOOK SAMPLE ***
Licence text that must never appear in a passage.
"""


def test_same_seed_same_prompts_and_all_distinct() -> None:
    first = task_prompts(500, seed=3)
    assert first == task_prompts(500, seed=3)
    assert first != task_prompts(500, seed=4)
    assert len(first) == len(set(first)) == 500


def test_prompts_cover_several_kinds() -> None:
    prompts = task_prompts(2000, seed=0)
    assert sum(p.startswith("Solve for x") for p in prompts) > 20
    assert sum(p.startswith("Write a ") for p in prompts) > 200
    assert sum("Stay in character" in p or p.startswith(("Pretend", "Act as", "Take on")) for p in prompts) > 100
    assert sum("probability" in p for p in prompts) > 10
    assert all(20 < len(p) < 2000 for p in prompts)


def test_passages_skip_archive_header_and_licence(tmp_path: Path) -> None:
    passages = text_passages([GUTENBERG_LIKE], min_chars=300, max_chars=1200)
    assert passages and all("Licence" not in p and "Header" not in p for p in passages)
    assert any("Alpha" in p for p in passages)
    (tmp_path / "play_gut.txt").write_text(GUTENBERG_LIKE, encoding="utf-8")
    assert passages_from_files([tmp_path / "play_gut.txt"]) == passages


def test_passage_tasks_quote_a_passage() -> None:
    passage = "A long passage about a lighthouse. " * 12
    prompts = task_prompts(300, seed=1, passages=[passage], passage_share=0.5)
    with_passage = [p for p in prompts if p.endswith(passage)]
    assert 0 < len(with_passage) < len(prompts)
    assert all(p.split("\n\n")[0].endswith((".", "?")) for p in with_passage)
