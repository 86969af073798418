"""`omni-runtime serve`: an OpenAI-compatible HTTP front end over the pipeline.

One more client of the orchestrators (one `OmniClient` per server process);
any number of server replicas can run against one Redis.
"""

from omni_runtime.http.app import create_app
from omni_runtime.http.settings import ServeSettings

__all__ = ["ServeSettings", "create_app"]
