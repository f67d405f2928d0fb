"""C functions already loaded into this process (by torch: libgomp; by Python: the C library), looked up by name."""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from typing import Any

__all__ = ["process_function"]

log = logging.getLogger(__name__)


@cache
def process_function(name: str, argtypes: tuple[Any, ...], restype: Any) -> Any | None:
    """The function `name` from the process's global namespace with its C signature, or None (logged) where no
    loaded library defines it."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        log.debug("no %s in this process", name)
        return None
    function.argtypes = list(argtypes)
    function.restype = restype
    return function
