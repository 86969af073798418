"""What the speech engines' tests share: fixed sentences, token-like deltas, stage output."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from omni_runtime.stage_api import Final

SENTENCES = (
    "The quick brown fox jumps over the lazy dog. "
    "Please call me back when you get home tonight. "
    "I would like a cup of coffee and a piece of cake, please."
)
MAX_WER = 0.35


def token_deltas(text: str) -> list[str]:
    """The text as an LLM streams it: word pieces with their leading space, marks apart."""
    return re.findall(r" ?\w{1,4}|[^\w ]| ", text)


def unwrap(outputs: Iterable[Any]) -> list[Any]:
    """A stage generator's outputs as chunks (its last is a `Final`)."""
    outs = list(outputs)
    assert outs and isinstance(outs[-1], Final), "the last chunk must be marked Final"
    assert not any(isinstance(o, Final) for o in outs[:-1])
    return [o.data if isinstance(o, Final) else o for o in outs]


def audio(chunks: Iterable[Any]) -> npt.NDArray[np.float32]:
    parts = [np.asarray(c, dtype=np.float32) for c in chunks]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
