"""Decoding: sampling rules, stop conditions, plain autoregressive generation and the engine front."""
