"""`dflash serve`: an OpenAI-, Anthropic- and Responses-compatible HTTP front door for one `Engine`.

`create_app(engine, settings)` builds the FastAPI application; a pool of worker threads starts generations
in arrival order (see `worker`), each API module translates its wire format to a `Turn` (see `turn`) and
back. The HTTP stack (fastapi, uvicorn, pydantic, prometheus-client) is the optional `server` extra.
"""

from dflash.server.app import create_app
from dflash.server.settings import ServerSettings
from dflash.server.stall import StallSettings

__all__ = ["ServerSettings", "StallSettings", "create_app"]
