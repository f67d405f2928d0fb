"""Decoding: sampling rules and the token chooser, stop conditions and streamed output, chunked prefill (also through
the prefix cache), plain autoregressive and batched generation, token constraints for tool calls and grammars."""
