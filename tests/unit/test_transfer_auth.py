"""The transfer plane's capabilities and bounds (issue 47), over real ZMQ endpoints on loopback.

A push, a remote-write claim or a fetch is accepted only when sealed with the capability of the
slot it names (``transfer.capability``), made from the deployment token: a peer without it, or with
another token, or sealing for another slot, request or receiver, is refused with a reason that says
nothing of what is held, and counted; an authentic request sent again is refused as a replay and
counted; a frame larger than the pool is dropped by the socket and the endpoint keeps serving;
ids a peer sends are logged cut and escaped.
"""

from __future__ import annotations

import logging

import pytest
import torch
import zmq

from triptych.transfer import TransferConfig, TransferRejected, TransferTimeout
from triptych.transfer.capability import TransferKey
from triptych.transfer.gate import REFUSED
from triptych.transfer.lending import Lending
from triptych.transfer.messages import ACK_DECODER, ENCODER, DataPush, FetchRequest, WriteClaim
from triptych.transfer.peer import PeerEndpoint

TOKEN = "auth-test-token-" + "1" * 48
CONFIG = TransferConfig(max_slots=4, max_bytes=1 << 20, poll_interval_s=0.01, token=TOKEN)
STRANGER = TransferConfig(max_slots=4, max_bytes=1 << 20, poll_interval_s=0.01, token="s" * 64)
FORGED = "\nCRITICAL triptych.head: forged"


@pytest.fixture
def endpoints():
    made: list[PeerEndpoint] = []

    def make(name: str, config: TransferConfig = CONFIG) -> PeerEndpoint:
        made.append(PeerEndpoint(name, config))
        return made[-1]

    yield make
    for endpoint in made:
        endpoint.close()


class Raw:
    """A bare DEALER to one endpoint: sends frames as given, returns the Ack (or None)."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, frames: list[bytes], wait_s: float = 5.0):
        self.sock.send_multipart(frames)
        if not self.sock.poll(wait_s * 1000, zmq.POLLIN):
            return None
        return ACK_DECODER.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def raw():
    opened: list[Raw] = []

    def make(address: str) -> Raw:
        opened.append(Raw(address))
        return opened[-1]

    yield make
    for r in opened:
        r.close()


def push_frames(ref, tensor: torch.Tensor, sender: str, token: str = TOKEN, slot: int | None = None, seq: int = 1):
    """The frames a sender with ``token`` would send to fill ``ref`` (sealed for ``slot``)."""
    slot = ref.slot if slot is None else slot
    header = ENCODER.encode(DataPush(seq, ref.transfer_id, sender, ref.dtype, ref.shape, ref.nbytes, ref.request, slot))
    key = TransferKey(token)
    mac = key.seal(key.capability(ref.transfer_id, ref.request, ref.owner, slot), header)
    return [header, mac, tensor.numpy().tobytes()]


def test_a_capability_binds_every_field_of_its_slot_and_the_token():
    key = TransferKey(TOKEN)
    base = ("r1/g0/cond/x", "r1", "denoiser-0", 3)
    header = b"header"
    mac = key.seal(key.capability(*base), header)
    assert key.verify(key.capability(*base), header, mac)
    for i, other in enumerate(("r1/g0/cond/y", "r2", "denoiser-1", 4)):
        changed = list(base)
        changed[i] = other
        assert not key.verify(key.capability(*changed), header, mac), f"field {i} not bound"
    assert not key.verify(key.capability(*base), b"headex", mac)  # the header is bound
    assert not TransferKey("o" * 64).verify(TransferKey("o" * 64).capability(*base), header, mac)


def test_a_push_from_a_peer_with_another_token_is_refused_and_the_slot_keeps_its_real_bytes(endpoints):
    rx, tx, stranger = endpoints("rx"), endpoints("tx"), endpoints("tx", STRANGER)  # the stranger claims tx's id
    real, fake = torch.arange(6, dtype=torch.float32), torch.full((6,), -1.0)
    ref = rx.reserve("r1/g0/cond/x", torch.float32, (6,), "tx", 10, request="r1")
    with pytest.raises(TransferRejected) as refused:
        stranger.push(ref, fake)
    assert refused.value.args[0].endswith(f": {REFUSED}")  # nothing of the slot's shape or state
    assert rx.stats.unauthenticated == 1 and rx.pool.get(ref.transfer_id).state.value == "reserved"
    tx.push(ref, real)
    assert torch.equal(rx.wait_ready(ref.transfer_id, 5), real)


def test_unsealed_and_forged_frames_are_refused_alike_and_counted(endpoints, raw):
    rx = endpoints("rx")
    ref = rx.reserve("r1/g0/cond/x", torch.float32, (6,), "tx", 10, request="r1")
    data = torch.ones(6)
    sealed = push_frames(ref, data, "tx")
    door = raw(rx.address)
    answers = [
        door.send([sealed[0], sealed[2]]),  # no mac at all (the payload where the mac belongs)
        door.send([sealed[0], b"\0" * 32, sealed[2]]),  # a made-up mac
        door.send(push_frames(ref, data, "tx", token="s" * 64)),  # another deployment's token
        door.send(push_frames(ref, data, "tx", slot=ref.slot + 1)),  # the capability of another slot
        door.send([b"\xff" * 40, b"\0" * 32]),  # no header at all
    ]
    assert [(a.ok, a.reason, a.transfer_id) for a in answers] == [(False, REFUSED, "")] * 5
    assert rx.stats.unauthenticated == 5 and rx.stats.pushes_received == 0
    assert door.send(sealed).ok  # the real one still fills it
    assert torch.equal(rx.wait_ready(ref.transfer_id, 5), data)


def test_an_authentic_push_replayed_is_refused_and_counted_and_no_other_receiver_takes_it(endpoints, raw):
    rx, other = endpoints("rx"), endpoints("rx-2")
    ref = rx.reserve("r1/g0/cond/x", torch.float32, (6,), "tx", 10, request="r1")
    other.reserve("r1/g0/cond/x", torch.float32, (6,), "tx", 10, request="r1")  # same id on another receiver
    first = torch.arange(6, dtype=torch.float32)
    frames = push_frames(ref, first, "tx")
    door = raw(rx.address)
    assert door.send(frames).ok
    again = door.send(frames)  # the slot is filled
    assert not again.ok and rx.stats.replays_refused == 1
    assert torch.equal(rx.wait_ready(ref.transfer_id, 5), first)
    later = door.send(frames)  # the slot is released
    assert not later.ok and rx.stats.replays_refused == 2
    elsewhere = raw(other.address).send(frames)  # sealed for rx: worthless to rx-2
    assert (elsewhere.ok, elsewhere.reason) == (False, REFUSED) and other.stats.unauthenticated == 1


class Lends:
    """A lender that lends one tensor under any key, and records who it lent to."""

    def __init__(self) -> None:
        self.lent: list[str] = []

    def lend(self, key, ref, loan):
        self.lent.append(loan)
        return torch.arange(ref.shape[0], dtype=torch.float32)

    def give_back(self, loan, pushed):
        pass


def test_a_fetch_without_a_valid_capability_gets_nothing_pushed(endpoints):
    holder, asker, stranger = endpoints("enc-a"), endpoints("enc-b"), endpoints("enc-c", STRANGER)
    lender = Lends()
    holder.lend_from(Lending(lender, holder.push))
    # A stranger reserves a slot of its own and asks the holder to push there: refused, nothing sent.
    ref = stranger.reserve("mm/x", torch.float32, (4,), "enc-a", 10)
    msg = FetchRequest(stranger.sender.next_seq(), ref.transfer_id, "enc-c", ref.nbytes, "key", ref)
    ack = stranger.sender.ask(holder.address, msg, 5)
    assert (ack.ok, ack.reason) == (False, REFUSED) and lender.lent == []
    with pytest.raises(TransferTimeout):
        stranger.wait_ready(ref.transfer_id, 0.5)
    # A token holder's fetch is served.
    ref = asker.reserve("mm/y", torch.float32, (4,), "enc-a", 10)
    msg = FetchRequest(asker.sender.next_seq(), ref.transfer_id, "enc-b", ref.nbytes, "key", ref)
    assert asker.sender.ask(holder.address, msg, 5).ok
    assert torch.equal(asker.wait_ready(ref.transfer_id, 5), torch.arange(4, dtype=torch.float32))
    assert holder.stats.unauthenticated == 1 and len(lender.lent) == 1


def test_a_fetch_naming_a_third_partys_address_unsealed_sends_nothing_there(endpoints, raw):
    holder, victim = endpoints("enc-a"), endpoints("victim")
    lender = Lends()
    holder.lend_from(Lending(lender, holder.push))
    ref = victim.reserve("mm/z", torch.float32, (4,), "enc-a", 10)  # the asker names the victim's slot
    header = ENCODER.encode(FetchRequest(1, ref.transfer_id, "victim", ref.nbytes, "key", ref))
    ack = raw(holder.address).send([header, b"\0" * 32])
    assert (ack.ok, ack.reason) == (False, REFUSED) and lender.lent == []
    with pytest.raises(TransferTimeout):
        victim.wait_ready(ref.transfer_id, 0.5)


def test_a_write_claim_without_a_capability_is_refused(endpoints, raw):
    rx = endpoints("rx")
    ref = rx.reserve("r1/g0/cond/x", torch.float32, (6,), "tx", 10, request="r1")
    header = ENCODER.encode(WriteClaim(1, ref.transfer_id, "tx", ref.nbytes, ref.request, ref.slot))
    ack = raw(rx.address).send([header, b"\0" * 32])
    assert (ack.ok, ack.reason) == (False, REFUSED) and rx.stats.unauthenticated == 1


def test_a_frame_larger_than_the_pool_is_dropped_unread_and_the_endpoint_keeps_serving(endpoints, raw):
    rx, tx = endpoints("rx"), endpoints("tx")
    assert rx._router.getsockopt(zmq.MAXMSGSIZE) == CONFIG.max_bytes
    assert raw(rx.address).send([b"h", b"\0" * 32, b"\0" * (2 * CONFIG.max_bytes)], wait_s=1.0) is None
    assert rx.stats.rejected_pushes == 0  # never reached the endpoint's code
    ref = rx.reserve("after", torch.float32, (6,), "tx", 10)
    tx.push(ref, torch.ones(6))
    assert torch.equal(rx.wait_ready("after", 5), torch.ones(6))


def test_a_huge_newline_bearing_id_is_logged_short_and_escaped(endpoints, raw, caplog):
    rx = endpoints("rx", TransferConfig(max_bytes=4 << 20, token=TOKEN))  # room for a 1 MiB header frame
    door = raw(rx.address)
    huge = FORGED + "x" * (1 << 20)
    stranger = TransferKey("s" * 64)
    long_id = FORGED + "y" * (30 << 10)  # fits the header bound: decoded, its mac checked, refused

    def sealed(tid: str, key: TransferKey) -> list[bytes]:
        header = ENCODER.encode(DataPush(1, tid, FORGED, "float32", (1,), 4, "", 0))
        return [header, key.seal(key.capability(tid, "", "rx", 0), header), b"\0" * 4]

    with caplog.at_level(logging.INFO, logger="triptych.transfer"):
        assert not door.send(sealed(huge, stranger)).ok  # a header past the bound: refused unread
        rx.gate._refused = 999  # the next refusal is the 1000th: logged
        assert not door.send(sealed(long_id, stranger)).ok
        assert not door.send(sealed(long_id, TransferKey(TOKEN))).ok  # authentic: no such slot
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("triptych.transfer")]
    assert len(lines) == 3, lines
    for line in lines:
        assert "\n" not in line and len(line) < 400, line[:500]
    assert all("\\nCRITICAL" in line for line in lines[1:])  # the newline shown escaped
