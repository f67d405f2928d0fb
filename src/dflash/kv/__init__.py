"""Key/value caches: the static per-sequence cache and (later) the prefix cache."""
