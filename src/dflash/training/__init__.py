"""Drafter training: data answered by the target itself, the anchor-block objective, the trainer (warm start,
growth), export, and exact replay to evaluate acceptance."""
