"""The batched replay evaluation reproduces the real linear decoding loop round by round."""

from __future__ import annotations

from dflash.generation.batched import generate_batch
from dflash.training.replay import replay
from tests.spec_helpers import golden_pair, random_prompts, run
from tests.test_ddtree_decode import run_ddtree


def test_replay_equals_the_decoding_loop() -> None:
    target, drafter = golden_pair()
    prompts = random_prompts(4, 1000, seed=1008, lengths=(94, 12, 40, 70))
    answers = generate_batch(target, prompts, max_new_tokens=80, eos_ids=())
    rounds_with_acceptance = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        tokens, stats = run(target, drafter, prompt, 80)
        assert tokens == answer  # batched greedy (left-padded) equals one-at-a-time greedy
        replayed = replay(target, drafter, prompt, answer, [])[0].acceptance_lengths  # linear rounds alone
        assert replayed == [a + 1 for a in stats.accepted_per_round]
        rounds_with_acceptance += sum(1 for a in stats.accepted_per_round if a)
    assert rounds_with_acceptance > 0


def test_tree_replay_equals_the_ddtree_loop() -> None:
    target, drafter = golden_pair()
    prompts = random_prompts(4, 1000, seed=1008, lengths=(94, 12, 40, 70))
    budgets = [4, 16]
    max_new = 64
    answers = generate_batch(target, prompts, max_new_tokens=max_new, eos_ids=())
    rounds_with_acceptance = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        _, replayed = replay(target, drafter, prompt, answer, budgets, max_new_tokens=max_new)
        for budget in budgets:
            tokens, stats = run_ddtree(target, drafter, prompt, max_new, budget=budget)
            assert tokens == answer
            assert replayed[budget].acceptance_lengths == [a + 1 for a in stats.accepted_per_round]
            rounds_with_acceptance += sum(1 for a in stats.accepted_per_round if a)
    assert rounds_with_acceptance > 0
