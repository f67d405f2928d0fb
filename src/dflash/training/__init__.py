"""Drafter training: data answered by the target itself, the anchor-block objective, checkpoints, export."""
