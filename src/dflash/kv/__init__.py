"""Key/value caches: the static per-sequence cache and the prefix cache shared across requests."""
