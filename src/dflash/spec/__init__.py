"""Speculative decoding: draft trees (DDTree) and their verification."""
