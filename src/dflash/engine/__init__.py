"""The engine: a loaded target (and drafter) serving generation requests one at a time."""
