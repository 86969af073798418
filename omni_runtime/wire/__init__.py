"""The wire: every message's definition (`messages.py`), how values become bytes and back
(`codec.py`, numpy arrays as one msgpack ext: `ndarray.py`), and the one-pass read views of
the messages read per request or chunk (`views.py`)."""
