"""dflash-server: lossless speculative decoding (DFlash, DDTree) behind OpenAI/Anthropic APIs."""

__version__ = "0.1.0"
