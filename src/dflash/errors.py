"""User-facing error types. Each carries a message meant to be read by a person."""


class DFlashError(Exception):
    """Base class of every error the project raises on purpose."""


class ModelLoadError(DFlashError):
    """A model or drafter file is missing, truncated, inconsistent or of an unsupported kind."""


class DrafterMismatchError(DFlashError):
    """A drafter does not fit the target it was paired with."""


class GenerationError(DFlashError):
    """A request cannot be served as asked (bad parameters, context too long...)."""
