"""Both transfer backends over loopback: bytes identical, every failure path frees its slot.

Each test gets a receiver `rx` and a sender `tx` of one backend; teardown checks that the
receiver is back at full capacity (no slot, no arena range, nothing parked).
"""

import multiprocessing as mp
import threading
from dataclasses import replace

import msgspec
import pytest
import torch

from tests.helpers import NEEDS_MOONCAKE
from triptych.transfer import (
    DuplicateTransfer,
    PeerLost,
    SlotUnavailable,
    TransferCancelled,
    TransferConfig,
    TransferRejected,
    TransferTimeout,
    bundle_specs,
    decode_ref,
    encode_ref,
    make_endpoint,
    mooncake_available,
)
from triptych.transfer.messages import WriteClaim, WriteDone

BACKENDS = [pytest.param("zmq"), pytest.param("mooncake", marks=NEEDS_MOONCAKE)]
# An explicit token: the spawned sender (its own import of this module) must share it.
TOKEN = "transfer-test-token-" + "0" * 44
# Small staging so tensors above 64 KiB exercise Mooncake's chunked writes.
CONFIG = TransferConfig(max_slots=8, max_bytes=1 << 20, staging_bytes=64 << 10, poll_interval_s=0.01, token=TOKEN)
DTYPES = [torch.float32, torch.bfloat16, torch.int64]
SHAPES = [(), (7,), (3, 4, 5), (160, 200), (0, 3)]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


@pytest.fixture(params=BACKENDS)
def pair(request):
    rx = make_endpoint(request.param, "rx", CONFIG)
    tx = make_endpoint(request.param, "tx", CONFIG)
    yield rx, tx
    try:
        assert rx.idle(), f"receiver not back at full capacity: {rx.pool.live()}"
        assert tx.idle()
    finally:
        tx.close()
        rx.close()


def test_roundtrip_is_byte_identical(pair):
    rx, tx = pair
    for i, (dtype, shape) in enumerate((d, s) for d in DTYPES for s in SHAPES):
        sent = sample(dtype, shape, seed=i)
        ref = rx.reserve(f"t{i}", dtype, shape, peer="tx", timeout_s=10)
        tx.push(ref, sent)
        received = rx.wait_ready(ref.transfer_id, timeout_s=10)
        assert same_bytes(received, sent), (dtype, shape)
    assert rx.stats.pushes_received == tx.stats.pushes_sent == len(DTYPES) * len(SHAPES)


def test_non_contiguous_tensor_is_sent_contiguous(pair):
    rx, tx = pair
    sent = sample(torch.float32, (6, 9)).t()
    ref = rx.reserve("nc", sent.dtype, sent.shape, "tx", 10)
    tx.push(ref, sent)
    assert same_bytes(rx.wait_ready("nc", 10), sent)


def test_received_tensor_owns_its_storage(pair):
    rx, tx = pair
    first = rx.reserve("own1", torch.float32, (64,), "tx", 10)
    tx.push(first, torch.ones(64))
    kept = rx.wait_ready("own1", 10)
    second = rx.reserve("own2", torch.float32, (64,), "tx", 10)
    tx.push(second, torch.zeros(64))
    rx.wait_ready("own2", 10)
    assert torch.equal(kept, torch.ones(64))


def test_bundle_roundtrip(pair):
    rx, tx = pair
    tensors = {
        "prompt_embeds": sample(torch.bfloat16, (1, 12, 32)),
        "pooled": sample(torch.float32, (1, 32), seed=1),
        "ids": sample(torch.int64, (1, 12), seed=2),
    }
    refs = rx.reserve_bundle("req-1", bundle_specs(tensors), peer="tx", timeout_s=10)
    tx.push_bundle(refs, tensors)
    received = rx.wait_bundle(refs, timeout_s=10)
    assert all(same_bytes(received[k], tensors[k]) for k in tensors)


def test_push_without_reservation_is_rejected(pair):
    rx, tx = pair
    ref = rx.reserve("real", torch.float32, (4,), "tx", 10)
    forged = msgspec.structs.replace(ref, transfer_id="forged")
    with pytest.raises(TransferRejected, match="no live reservation"):
        tx.push(forged, torch.zeros(4))
    assert rx.stats.rejected_pushes == 1
    rx.release("real")


def test_duplicate_reservation_is_rejected(pair):
    rx, _ = pair
    rx.reserve("dup", torch.float32, (4,), "tx", 10)
    with pytest.raises(DuplicateTransfer):
        rx.reserve("dup", torch.float32, (4,), "tx", 10)
    rx.release("dup")


def test_duplicate_push_is_rejected(pair):
    rx, tx = pair
    ref = rx.reserve("twice", torch.float32, (4,), "tx", 10)
    tx.push(ref, torch.ones(4))
    with pytest.raises(TransferRejected, match="duplicate push"):
        tx.push(ref, torch.zeros(4))
    assert torch.equal(rx.wait_ready("twice", 10), torch.ones(4))


def test_wrong_size_push_is_rejected_and_slot_kept(pair):
    rx, tx = pair
    ref = rx.reserve("size", torch.float32, (4,), "tx", 10)
    bigger = msgspec.structs.replace(ref, shape=(5,), nbytes=20)
    with pytest.raises(TransferRejected, match="bytes"):
        tx.push(bigger, torch.zeros(5))
    tx.push(ref, torch.ones(4))
    assert torch.equal(rx.wait_ready("size", 10), torch.ones(4))
    assert rx.stats.rejected_pushes == 1


def test_push_from_other_sender_is_rejected(pair):
    rx, tx = pair
    ref = rx.reserve("theirs", torch.float32, (4,), peer="someone-else", timeout_s=10)
    with pytest.raises(TransferRejected, match="not the reserved peer"):
        tx.push(ref, torch.zeros(4))
    rx.release("theirs")


def test_sender_checks_tensor_against_ref(pair):
    rx, tx = pair
    ref = rx.reserve("mismatch", torch.float32, (4,), "tx", 10)
    with pytest.raises(ValueError, match="dtype"):
        tx.push(ref, torch.zeros(4, dtype=torch.float64))
    assert rx.stats.rejected_pushes == 0
    rx.release("mismatch")


def test_wait_timeout_releases_slot_and_later_push_is_rejected(pair):
    rx, tx = pair
    ref = rx.reserve("slow", torch.float32, (4,), "tx", timeout_s=10)
    with pytest.raises(TransferTimeout):
        rx.wait_ready("slow", timeout_s=0.05)
    assert rx.idle()
    with pytest.raises(TransferRejected):
        tx.push(ref, torch.zeros(4))


def test_reservation_deadline_expires_slot(pair):
    rx, _ = pair
    rx.reserve("expiring", torch.float32, (4,), "tx", timeout_s=0.05)
    with pytest.raises(TransferTimeout, match="expired"):
        rx.wait_ready("expiring")  # no wait timeout: the receiver's deadline releases it
    assert rx.stats.timeouts == 1


def test_cancel_releases_both_ends(pair):
    rx, tx = pair
    ref = rx.reserve("cancelled", torch.float32, (4,), "tx", 10)
    waiter_error: list[BaseException] = []

    def wait() -> None:
        try:
            rx.wait_ready("cancelled", timeout_s=10)
        except TransferCancelled as exc:
            waiter_error.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert rx.cancel("cancelled")
    waiter.join(10)
    assert len(waiter_error) == 1
    with pytest.raises(TransferRejected):
        tx.push(ref, torch.zeros(4))
    assert rx.stats.cancels == 1 and not rx.cancel("cancelled")


def test_dead_peer_slots_are_reclaimed(pair):
    rx, _ = pair
    rx.reserve("p1", torch.float32, (4,), "tx", 10)
    rx.reserve("p2", torch.float32, (4,), "tx", 10)
    rx.reserve("other", torch.float32, (4,), "alive", 10)
    assert sorted(rx.reclaim_peer("tx")) == ["p1", "p2"]
    with pytest.raises(PeerLost):
        rx.wait_ready("p1", timeout_s=1)
    assert rx.pool.in_use == 1
    rx.release("other")


def test_capacity_exhausted_then_full_again(pair):
    rx, _ = pair
    for i in range(CONFIG.max_slots):
        rx.reserve(f"c{i}", torch.float32, (16,), "tx", 10)
    with pytest.raises(SlotUnavailable):
        rx.reserve("one-too-many", torch.float32, (16,), "tx", 10)
    for i in range(CONFIG.max_slots):
        assert rx.release(f"c{i}")


def test_auto_on_a_loopback_host_is_zmq_which_binds_only_that_host():
    """Mooncake's engine listens on every interface whatever host it is given; an endpoint bound to
    loopback must not, so "auto" takes ZMQ there (its socket binds the given address only)."""
    from triptych.transfer.factory import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.5") and not is_loopback("gpu-node-3")
    with make_endpoint("auto", "auto", CONFIG) as endpoint:
        assert CONFIG.host == "127.0.0.1" and endpoint.kind == "zmq"
        assert endpoint.address.startswith("tcp://127.0.0.1:")


def test_unknown_backend_kind_raises():
    with pytest.raises(ValueError, match="nccl"):
        make_endpoint("nccl", "x", CONFIG)  # type: ignore[arg-type]


def test_a_peer_with_another_token_writes_nothing_into_a_reserved_slot(pair):
    """Its push (a frame, or a Mooncake claim before any write) is refused; the slot's memory is as
    it was, and the real sender's bytes land."""
    rx, tx = pair
    with make_endpoint(rx.kind, "tx", replace(CONFIG, token="s" * 64)) as stranger:  # it claims tx's id
        sent = sample(torch.float32, (64, 8))
        ref = rx.reserve("guarded", sent.dtype, sent.shape, "tx", 10)
        entry = rx._entries["guarded"]
        before = None if entry.offset is None else rx.carrier.read(entry.offset, ref)
        with pytest.raises(TransferRejected, match="refused$"):
            stranger.push(ref, torch.full_like(sent, -7.0))
        if before is not None:  # Mooncake: nothing was written into the arena range
            assert same_bytes(rx.carrier.read(entry.offset, ref), before)
        assert rx.stats.unauthenticated == 1 and rx.stats.pushes_received == 0
        tx.push(ref, sent)
        assert same_bytes(rx.wait_ready("guarded", 10), sent)


@NEEDS_MOONCAKE
def test_claimed_range_is_parked_until_the_write_ends():
    with make_endpoint("mooncake", "rx", CONFIG) as rx, make_endpoint("mooncake", "tx", CONFIG) as tx:
        ref = rx.reserve("parked", torch.float32, (4,), "tx", 10)
        tx.sender.request(ref, WriteClaim(1, "parked", "tx", ref.nbytes, ref.request, ref.slot), [], 10)
        rx.cancel("parked")
        assert rx.pool.is_full_capacity() and not rx.idle()  # range held for the in-flight write
        with pytest.raises(TransferRejected, match="released before the write"):
            tx.sender.request(ref, WriteDone(2, "parked", "tx", ref.nbytes, False, ref.request, ref.slot), [], 10)
        assert rx.idle()


@NEEDS_MOONCAKE
@pytest.mark.parametrize(("rx_kind", "tx_kind"), [("mooncake", "zmq"), ("zmq", "mooncake")])
def test_backends_interoperate(rx_kind, tx_kind):
    with make_endpoint(rx_kind, "rx", CONFIG) as rx, make_endpoint(tx_kind, "tx", CONFIG) as tx:
        sent = sample(torch.bfloat16, (33, 17))
        ref = rx.reserve("mixed", sent.dtype, sent.shape, "tx", 10)
        tx.push(ref, sent)
        assert same_bytes(rx.wait_ready("mixed", 10), sent)
        assert rx.idle()


def _sender_process(jobs: list[tuple[str, list[bytes]]], done) -> None:
    """Child: for each backend, push seeded tensors into the refs the parent reserved."""
    try:
        for kind, blobs in jobs:
            with make_endpoint(kind, "child", CONFIG) as tx:
                for i, blob in enumerate(blobs):
                    ref = decode_ref(blob)
                    tx.push(ref, sample(ref.torch_dtype, ref.shape, seed=100 + i))
        done.put("ok")
    except (RuntimeError, ValueError) as exc:  # TransferError is a RuntimeError
        done.put(f"{type(exc).__name__}: {exc}")


def test_sender_in_spawned_process():
    """One spawned child (imports dominate its cost) sends to a receiver of each backend."""
    kinds = ["zmq", "mooncake"] if mooncake_available() else ["zmq"]
    specs = [(torch.float32, (8, 16)), (torch.bfloat16, (200, 300)), (torch.int64, (5,))]
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    receivers = {kind: make_endpoint(kind, f"parent-{kind}", CONFIG) for kind in kinds}
    try:
        refs = {
            kind: [rx.reserve(f"x{i}", d, s, "child", 60) for i, (d, s) in enumerate(specs)]
            for kind, rx in receivers.items()
        }
        jobs = [(kind, [encode_ref(r) for r in refs[kind]]) for kind in kinds]
        child = ctx.Process(target=_sender_process, args=(jobs, done))
        child.start()
        try:
            received = {
                kind: [rx.wait_ready(r.transfer_id, timeout_s=60) for r in refs[kind]] for kind, rx in receivers.items()
            }
            assert done.get(timeout=60) == "ok"
        finally:
            child.join(60)
        assert child.exitcode == 0
        for kind in kinds:
            for i, ((dtype, shape), got) in enumerate(zip(specs, received[kind], strict=True)):
                assert same_bytes(got, sample(dtype, shape, seed=100 + i)), (kind, i)
            assert receivers[kind].idle()
    finally:
        for rx in receivers.values():
            rx.close()
