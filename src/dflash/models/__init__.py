"""Model runtime: configuration-driven decoder-only transformers with hidden-state capture."""
