"""SlotPool and ByteArena bookkeeping: one behaviour per test."""

import pytest

from triptych.transfer.arena import ByteArena
from triptych.transfer.base import TransferConfig
from triptych.transfer.errors import DuplicateTransfer, SlotUnavailable, UnknownTransfer
from triptych.transfer.slots import SlotPool, SlotState


def make_pool(slots: int = 2, nbytes: int = 100) -> SlotPool:
    return SlotPool(max_slots=slots, max_bytes=nbytes)


def test_reserve_ready_release_cycle():
    pool = make_pool()
    slot = pool.reserve("t1", 40, peer="a", deadline=10.0)
    assert (pool.in_use, pool.free_slots, pool.free_bytes) == (1, 1, 60)
    assert pool.mark_ready("t1").state is SlotState.READY
    assert pool.release("t1").slot == slot
    assert pool.is_full_capacity()


def test_live_duplicate_id_rejected():
    pool = make_pool()
    pool.reserve("t1", 10, "a", 10.0)
    with pytest.raises(DuplicateTransfer):
        pool.reserve("t1", 10, "a", 10.0)


def test_released_id_cannot_be_reused():
    pool = make_pool()
    pool.reserve("t1", 10, "a", 10.0)
    pool.release("t1")
    with pytest.raises(DuplicateTransfer):
        pool.reserve("t1", 10, "a", 10.0)


def test_released_ids_are_remembered_up_to_the_bound_oldest_forgotten_first():
    pool = SlotPool(max_slots=2, max_bytes=100, remember_finished=2)
    for tid in ("t1", "t2", "t3"):
        pool.reserve(tid, 10, "a", 10.0)
        pool.release(tid)
    pool.reserve("t1", 10, "a", 10.0)  # the oldest of three released ids is forgotten: usable again
    for tid in ("t2", "t3"):
        with pytest.raises(DuplicateTransfer):
            pool.reserve(tid, 10, "a", 10.0)


def test_second_mark_ready_rejected():
    pool = make_pool()
    pool.reserve("t1", 10, "a", 10.0)
    pool.mark_ready("t1")
    with pytest.raises(DuplicateTransfer):
        pool.mark_ready("t1")


def test_mark_ready_unknown_raises():
    with pytest.raises(UnknownTransfer):
        make_pool().mark_ready("never")


def test_slot_capacity_exhausted():
    pool = make_pool(slots=2)
    pool.reserve("t1", 1, "a", 10.0)
    pool.reserve("t2", 1, "a", 10.0)
    with pytest.raises(SlotUnavailable):
        pool.reserve("t3", 1, "a", 10.0)


def test_byte_capacity_exhausted():
    pool = make_pool(slots=4, nbytes=100)
    pool.reserve("t1", 70, "a", 10.0)
    with pytest.raises(SlotUnavailable):
        pool.reserve("t2", 31, "a", 10.0)
    assert pool.in_use == 1


def test_oversized_request_rejected():
    with pytest.raises(SlotUnavailable):
        make_pool(nbytes=100).reserve("big", 101, "a", 10.0)


def test_expire_releases_due_slots_only():
    pool = make_pool()
    pool.reserve("early", 10, "a", deadline=1.0)
    pool.reserve("late", 10, "a", deadline=5.0)
    assert [s.transfer_id for s in pool.expire(now=2.0)] == ["early"]
    assert pool.get("late") is not None and pool.get("early") is None


def test_ready_slot_also_expires():
    pool = make_pool()
    pool.reserve("t1", 10, "a", deadline=1.0)
    pool.mark_ready("t1")
    assert [s.transfer_id for s in pool.expire(now=1.0)] == ["t1"]


def test_cancel_by_release_is_idempotent():
    pool = make_pool()
    pool.reserve("t1", 10, "a", 10.0)
    assert pool.release("t1") is not None
    assert pool.release("t1") is None
    assert pool.is_full_capacity()


def test_dead_peer_reclaim_releases_only_its_slots():
    pool = make_pool(slots=3)
    pool.reserve("a1", 10, "a", 10.0)
    pool.reserve("a2", 10, "a", 10.0)
    pool.reserve("b1", 10, "b", 10.0)
    assert sorted(s.transfer_id for s in pool.reclaim_peer("a")) == ["a1", "a2"]
    assert [s.transfer_id for s in pool.live()] == ["b1"]


def test_back_to_full_capacity_after_mixed_releases():
    pool = make_pool(slots=3, nbytes=90)
    for i, peer in enumerate("aab"):
        pool.reserve(f"t{i}", 30, peer, deadline=float(i))
    pool.mark_ready("t2")
    pool.expire(now=0.0)
    pool.reclaim_peer("a")
    pool.release("t2")
    assert pool.is_full_capacity() and pool.free_bytes == 90 and pool.free_slots == 3


def test_lowest_free_slot_is_reused():
    pool = make_pool(slots=3)
    pool.reserve("t0", 1, "a", 10.0)
    pool.reserve("t1", 1, "a", 10.0)
    pool.release("t0")
    assert pool.reserve("t2", 1, "a", 10.0) == 0


def test_arena_ranges_do_not_overlap_and_coalesce():
    arena = ByteArena(256, align=64)
    offsets = [arena.alloc(64) for _ in range(4)]
    assert offsets == [0, 64, 128, 192] and arena.alloc(1) is None
    for off in (64, 0, 192, 128):
        arena.free(off)
    assert arena.alloc(256) == 0


def test_arena_rounds_up_to_alignment():
    arena = ByteArena(256, align=64)
    assert arena.alloc(1) == 0
    assert arena.alloc(0) == 64
    assert arena.free_bytes == 128


def test_arena_double_free_raises():
    arena = ByteArena(128)
    off = arena.alloc(10)
    arena.free(off)
    with pytest.raises(KeyError):
        arena.free(off)


def test_config_rejects_zero_slots():
    with pytest.raises(ValueError, match="max_slots=0"):
        TransferConfig(max_slots=0)
