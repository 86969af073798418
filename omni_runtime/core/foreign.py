"""Calls into code the runtime does not own, whose exceptions it cannot list.

Stage code and engine adapters, a duck-typed connector or stage (SPEC §2), a
`forward_fn`, a `build_payload`, a hook or callback handed in from outside: any of these
may raise anything, and what it raises must not end a loop of the runtime, only the
request (or the call) it concerns. Each such call goes through `call` or `acall`, the
two places that catch every `Exception`, and comes back as its value or as `Raised`;
the caller decides what a failure means. `BaseException`s that are not `Exception`s
(a cancellation, `SystemExit`, `KeyboardInterrupt`) pass through.

The runtime's own code never goes through here: it catches what it knows can arrive.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Raised:
    """What a foreign call raised instead of returning (its traceback kept)."""

    error: Exception

    def describe(self) -> str:
        """`Type: message`, as error outputs name a cause."""
        return f"{type(self.error).__name__}: {self.error}"


def call(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T | Raised:
    """`fn(*args, **kwargs)`, or what it raised."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # foreign code may raise anything: handed back, never lost
        return Raised(e)


async def acall(fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T | Raised:
    """`await fn(*args, **kwargs)`, or what it raised (a cancellation is raised through)."""
    try:
        return await fn(*args, **kwargs)
    except Exception as e:  # foreign code may raise anything: handed back, never lost
        return Raised(e)
