"""Tensor parallelism: one process per device, the target's layers split across them (`sharding`, `layers`),
every rank running the same decoding loop in step with the first (`spmd`), launched by `launch`."""
