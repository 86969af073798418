"""The client process's room: `OmniClient` (`client.py`), its outputs' inbox, what a
listener hears (`playback.py`), and `bench`'s load (`loadgen.py`).

`from omni_runtime.client import OmniClient` is the documented import; it is resolved on
first use, so importing a sibling module does not import the client itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omni_runtime.client.client import OmniClient

__all__ = ["OmniClient"]


def __getattr__(name: str) -> Any:
    if name == "OmniClient":
        from omni_runtime.client.client import OmniClient

        return OmniClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
