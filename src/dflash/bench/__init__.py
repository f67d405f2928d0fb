"""Benchmarks that print figures: acceptance length per prompt set, decoding speed against baselines."""
