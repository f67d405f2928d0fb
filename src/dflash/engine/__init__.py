"""The engine: a loaded target (and drafter) serving generation requests from any thread, one at a time or together
through the batched core (`dflash.batch`); the choice of device and dtype, and loading from user-facing names."""
