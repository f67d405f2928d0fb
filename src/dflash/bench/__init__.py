"""Measurements that write results files: acceptance length and decoding speed against baselines, concurrent
requests, agent loops replayed from recorded transcripts, and the provenance each file carries."""
