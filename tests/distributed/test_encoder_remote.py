"""Two encoder processes on the default model, no shared directory, the head in front (issue 25,
"across instances"): an image chatted about on one encoder and then on the other runs the vision
tower once in all, the second encoder fetching the embedding from the first peer to peer (ZMQ
transfer plane); each answer is token-identical to the chat alone. When the fetch cannot work (the
entry evicted on the holder, the holder frozen and then killed) the second encoder runs its own
tower: the answer is still right, the failure is counted, and nothing stays held.

The second chat is sent to the other encoder by draining the holder (the head's affinity would
otherwise send it back to the holder). Waits are liveness bounds, never speed checks.
"""

from __future__ import annotations

import os
import signal
from dataclasses import replace

import pytest
from orchestrator_support import FAST_HEARTBEATS, Cluster

from shapeworld import render, sample_scenes
from triptych.chat import ChatParams, ChatTurn
from triptych.control.backend import ChatJob
from triptych.deploy.launch import TopologyConfig
from triptych.families.base import Role
from triptych.families.models import PACKAGED_DEFAULT
from triptych.families.registry import family_class
from triptych.mmcache.cache import MMCacheConfig

QUESTION = "What is in this image?"
TOKENS = 6


def ask(image) -> ChatParams:
    return ChatParams((ChatTurn("user", (0, QUESTION)),), (image,), max_tokens=TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def pictures():
    return [render(scene, 64) for scene in sample_scenes(4, "encoder-remote", "heldout")]


@pytest.fixture(scope="module")
def reference(pictures):
    """Each picture's answer from a plain in-process chat (no cache), and one entry's bytes."""
    plain = family_class(PACKAGED_DEFAULT)(
        PACKAGED_DEFAULT, roles={Role.ENCODER}, mm_cache_config=MMCacheConfig(max_mb=0)
    )
    cached = family_class(PACKAGED_DEFAULT)(PACKAGED_DEFAULT, roles={Role.ENCODER})
    cached.chat_model().run(ask(pictures[0]))
    return [plain.chat_model().run(ask(p)).text for p in pictures], cached.mm_cache.nbytes


@pytest.fixture(scope="module")
def cluster(reference):
    entry_bytes = reference[1]
    # room for one embedding per encoder (a second evicts the first once no chat holds it)
    flags = ("--mm-cache-mb", f"{1.5 * entry_bytes / (1 << 20):.6f}", "--mm-remote-timeout-s", "2")
    topology = TopologyConfig(
        encoders=2, denoisers=0, decoders=0, transfer="zmq", capacity=2, torch_threads=1, extra_args=flags
    )
    c = Cluster(PACKAGED_DEFAULT, topology, replace(FAST_HEARTBEATS, heartbeat_timeout_s=10.0))
    yield c
    c.close()


def chat(cluster, rid: str, image) -> str:
    return cluster.call(cluster.backend.chat(ChatJob(rid, ask(image)))).text


def instances(cluster) -> dict:
    return cluster.on_loop(lambda: dict(cluster.backend.orchestrator.registry.instances))


def caches(cluster) -> dict:
    """Each encoder's last reported mm-cache counters."""
    return {iid: i.stats.mm_cache for iid, i in instances(cluster).items() if i.stats is not None}


def settled(cluster, want) -> dict:
    """Wait until the encoders' reports satisfy ``want`` and no request holds an entry any more
    (they report on a timer: a report sent mid-chat still shows its entry held); a liveness bound."""
    end = [None]

    def ok(_desc):
        end[0] = caches(cluster)
        return len(end[0]) == 2 and want(end[0]) and all(c.held == 0 for c in end[0].values())

    cluster.wait_until(ok, "the encoders' reports", timeout=60)
    return end[0]


def the_one_that_ran(cs: dict, before: dict) -> tuple[str, str]:
    """(the encoder whose tower ran since ``before``, the other one)."""
    (ran,) = [iid for iid, c in cs.items() if c.forwards > before.get(iid, 0)]
    (other,) = set(cs) - {ran}
    return ran, other


def drained(cluster, iid: str, on: bool) -> None:
    def set_():
        cluster.backend.orchestrator.registry.instances[iid].draining = on

    cluster.on_loop(set_)


def forwards(cluster) -> dict[str, int]:
    return {iid: c.forwards for iid, c in caches(cluster).items()}


def test_an_image_chatted_about_on_one_encoder_then_on_the_other_runs_the_tower_once(cluster, reference, pictures):
    answers, entry_bytes = reference
    before = forwards(cluster)
    assert chat(cluster, "first", pictures[0]) == answers[0]
    holder, other = the_one_that_ran(settled(cluster, lambda cs: sum(c.forwards for c in cs.values()) == 1), before)
    drained(cluster, holder, True)
    try:
        assert chat(cluster, "second", pictures[0]) == answers[0]
    finally:
        drained(cluster, holder, False)
    cs = settled(cluster, lambda cs: cs[other].remote.hits == 1 and cs[holder].remote.lent == 1)
    assert (cs[holder].forwards, cs[other].forwards) == (1, 0)  # the tower ran once in all
    assert cs[other].remote.bytes == entry_bytes and cs[other].remote.failures == 0
    metrics = cluster.backend.metrics.registry
    assert metrics.get_sample_value("triptych_encoder_remote_fetches_total", {"result": "hit"}) == 1
    assert metrics.get_sample_value("triptych_encoder_remote_bytes_total") == entry_bytes


def test_an_entry_evicted_on_the_holder_is_encoded_here_and_counted(cluster, reference, pictures):
    answers, _ = reference
    first, rest = sorted(instances(cluster))
    drained(cluster, rest, True)  # both pictures on `first`: the second evicts the first there (room for one)
    try:
        assert chat(cluster, "evict-1", pictures[1]) == answers[1]
        assert chat(cluster, "evict-2", pictures[2]) == answers[2]
    finally:
        drained(cluster, rest, False)
    before = settled(cluster, lambda cs: cs[first].evictions >= 1)
    drained(cluster, first, True)
    try:
        assert chat(cluster, "evicted", pictures[1]) == answers[1]  # the head still names `first` as holder
    finally:
        drained(cluster, first, False)
    cs = settled(cluster, lambda cs: cs[rest].remote.refused == before[rest].remote.refused + 1)
    assert cs[rest].forwards == before[rest].forwards + 1  # computed here after the refusal
    assert cs[rest].remote.hits == before[rest].remote.hits


def test_a_holder_that_is_gone_falls_back_to_the_local_tower_and_leaks_nothing(cluster, reference, pictures):
    answers, _ = reference
    holder, other = sorted(instances(cluster))
    drained(cluster, other, True)
    try:
        assert chat(cluster, "gone-1", pictures[3]) == answers[3]
    finally:
        drained(cluster, other, False)
    before = settled(cluster, lambda cs: cs[holder].entries >= 1)
    pid = instances(cluster)[holder].pid
    drained(cluster, holder, True)
    os.kill(pid, signal.SIGSTOP)  # frozen: the fetch gets no answer (then killed, below)
    try:
        assert chat(cluster, "gone-2", pictures[3]) == answers[3]
    finally:
        os.kill(pid, signal.SIGKILL)
    cluster.wait_until(
        lambda d: any(i["id"] == holder and i["pid"] != pid for i in d["instances"]), "the holder restarted"
    )
    cs = settled(cluster, lambda cs: cs[other].remote.unreachable == before[other].remote.unreachable + 1)
    assert cs[other].forwards == before[other].forwards + 1 and cs[other].remote.hits == before[other].remote.hits
    report = next(i for i in cluster.describe()["instances"] if i["id"] == other)["report"]
    assert report["free_slots"] == report["max_slots"]  # the fetch's slot was released
