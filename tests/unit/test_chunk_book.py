"""The ChunkAdapter's bookkeeping without threads or I/O: SendBook and RecvBook."""

from __future__ import annotations

from typing import Any

from omni_runtime.core.chunk_book import SendBook, Staged
from omni_runtime.core.recv_book import Poll, RecvBook


def put_all(book: SendBook, ok: bool = True) -> list[tuple[str, int, Any]]:
    """Run the SAVE loop by hand: take every item, build it as is, put it as one batch."""
    batch: list[Staged] = []
    while (taken := book.take()) is not None:
        item, cancelled = taken
        if cancelled and not item.is_final:
            book.done(item)
            continue
        data = None if cancelled else item.snapshot
        batch.append(Staged(item.request_id, {"data": data, "finished": item.is_final}))
    book.number(batch)
    book.sent(batch, ok)
    return [(s.request_id, s.chunk_id, s.chunk["data"]) for s in batch]


def test_ids_are_contiguous_per_request_and_restart_after_a_final() -> None:
    book = SendBook()
    for i, final in ((0, False), (1, False), (2, True), (3, True)):
        book.save("a", i, final)
    book.save("b", "x", False)
    assert put_all(book) == [("a", 0, 0), ("a", 1, 1), ("a", 2, 2), ("a", 0, 3), ("b", 0, "x")]
    book.save("b", "y", True)
    assert put_all(book) == [("b", 1, "y")]
    assert book.tracked() == 0


def test_a_failed_put_advances_no_id() -> None:
    book = SendBook()
    book.save("a", 0, False)
    assert put_all(book, ok=False) == [("a", 0, 0)]
    book.save("a", 1, False)
    assert put_all(book) == [("a", 0, 1)]


def test_cancel_mid_stream_drops_non_finals_and_empties_the_final() -> None:
    book = SendBook()
    book.save("a", 0, False)
    put_all(book)
    book.save("a", 1, False)
    book.save("a", 2, True)
    book.cancel("a", now=0.0)
    assert put_all(book) == [("a", 1, None)]
    assert not book.is_cancelled("a")  # cleared by the final put
    assert book.tracked() == 0


def test_cancel_before_anything_was_saved_marks_the_request() -> None:
    book = SendBook()
    book.cancel("a", now=0.0)
    book.save("a", "p", False)
    book.save("a", "end", True)
    assert put_all(book) == [("a", 0, None)]
    assert book.tracked() == 0


def test_a_cancel_mark_is_forgotten_after_its_age_limit() -> None:
    book = SendBook(cancel_mark_ttl_s=10.0)
    book.cancel("old", now=0.0)
    book.cancel("new", now=5.0)
    book.expire(now=10.0)
    assert not book.is_cancelled("old") and book.is_cancelled("new")
    book.cancel("other", now=20.0)  # every cancel also expires what is too old
    assert not book.is_cancelled("new")
    assert book.tracked() == 1


def test_discard_clears_a_mark_of_a_request_with_nothing_saved() -> None:
    book = SendBook()
    book.cancel("a", now=0.0)
    book.discard("a", now=0.0)
    item, _cancelled = book.take() or (None, None)
    assert item is not None and item.purge
    assert book.purge(item) == 0
    assert book.tracked() == 0


def test_discard_mid_stream_queues_a_none_final_and_purges_every_id_written() -> None:
    book = SendBook()
    book.save("a", 0, False)
    book.save("a", 1, False)
    put_all(book)
    book.discard("a", now=0.0)
    taken = book.take()
    assert taken is not None
    item, cancelled = taken
    assert cancelled and item.is_final and not item.purge
    staged = [Staged("a", {"data": None, "finished": True})]
    book.number(staged)
    assert staged[0].chunk_id == 2
    book.sent(staged, ok=True)
    taken = book.take()
    assert taken is not None and taken[0].purge
    assert book.purge(taken[0]) == 3
    assert book.tracked() == 0


def recv_round(book: RecvBook, values: dict[tuple[str, int], object]) -> list[Poll]:
    batch = book.take_round()
    row = [values.get((p.request_id, p.next_id + j)) for p in batch for j in range(p.depth)]
    book.commit(batch, row)
    return batch


def test_recv_commits_in_order_reads_ahead_when_hot_and_parks_when_idle() -> None:
    book = RecvBook(read_ahead=4, parks=True)
    assert book.register("r") and not book.register("r")
    assert book.take_routes() == {"r": True}
    chunk = {"data": 0, "finished": False}
    assert [p.depth for p in recv_round(book, {("r", 0): chunk})] == [1]
    batch = recv_round(book, {("r", 1): chunk, ("r", 2): chunk})
    assert [(p.next_id, p.depth) for p in batch] == [(1, 4)]  # hot: read ahead
    assert book.take_ready() == {"r": [chunk] * 3}
    assert book.take_round() == [] and book.has_parked()  # the row ended: nothing more yet
    book.woken({"r": 3, "unknown": 5})
    assert [(p.next_id, p.depth, p.reported) for p in book.take_round()] == [(3, 1, True)]


def test_recv_reads_exactly_what_was_reported_then_parks() -> None:
    book = RecvBook(read_ahead=8, parks=True)
    book.register("r")
    chunk = {"data": 0, "finished": False}
    recv_round(book, {})
    assert book.has_parked()
    book.woken({"r": 1})
    batch = recv_round(book, {("r", 0): chunk, ("r", 1): chunk})
    assert [(p.next_id, p.depth) for p in batch] == [(0, 2)]
    assert book.take_round() == [] and book.has_parked()  # no read past what was reported
    book.woken({"r": 0})  # a stale report: already read
    assert book.take_round() == []
    book.woken({"r": 2})
    batch = book.take_round()
    book.woken({"r": 3})  # reported while the read was under way
    book.commit(batch, [chunk])
    assert [(p.next_id, p.depth) for p in book.take_round()] == [(3, 1)]
    assert book.take_ready() == {"r": [chunk] * 3}


def test_recv_a_reported_chunk_that_is_not_there_parks_and_the_sweep_reads_ahead() -> None:
    book = RecvBook(read_ahead=4, parks=True)
    book.register("r")
    recv_round(book, {})
    book.woken({"r": 0})
    recv_round(book, {})  # reported, yet absent (expired, deleted): no polling in a loop
    assert book.take_round() == [] and book.has_parked()
    chunk = {"data": 0, "finished": False}
    book.unpark_all()  # the safety net reads as a backlog: one id, then a full row ahead
    assert [p.depth for p in recv_round(book, {("r", 0): chunk})] == [1]
    assert [(p.next_id, p.depth) for p in recv_round(book, {})] == [(1, 4)]
    assert book.take_round() == []


def test_recv_token_check_makes_cleanup_a_barrier() -> None:
    book = RecvBook(read_ahead=1, parks=False)
    book.register("r")
    batch = book.take_round()
    book.cleanup("r")
    book.register("r")  # again, with a fresh token
    book.commit(batch, [{"data": "stale", "finished": True}])
    assert book.take_ready() == {}
    assert book.registered() == 1


def test_recv_a_finished_chunk_unregisters_and_a_malformed_one_is_skipped() -> None:
    book = RecvBook(read_ahead=1, parks=False)
    book.register("r")
    book.take_routes()
    done = book.commit(book.take_round(), [{"bad": 1}])
    assert done.malformed == [("r", 0)]
    done = book.commit(book.take_round(), [{"data": 1, "finished": True}])
    assert done.received == 1 and book.registered() == 0
    assert book.take_routes() == {"r": False}
