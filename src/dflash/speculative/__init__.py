"""Speculative decoding: the acceptance rule, the linear and DDTree (draft tree) loops and their tree functions."""
