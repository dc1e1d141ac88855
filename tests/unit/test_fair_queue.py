"""The head's waiting queue (``control.fair_queue``): priority classes, first come first served inside
a class, fair shares between tenants; and the tenant policies that feed it (``head.tenancy``)."""

from __future__ import annotations

import pytest

from triptych.control.fair_queue import FairQueue
from triptych.core.errors import InvalidParam
from triptych.head.state import tenant_of_key
from triptych.head.tenancy import Tenants, parse_policy


def drain(q: FairQueue, n: int | None = None) -> list[str]:
    """Start the first ``n`` (all) requests in queue order, as a router does."""
    out = []
    while q and (n is None or len(out) < n):
        out.append(q[0])
        q.take(out[-1])
    return out


def test_lower_priority_values_run_first_and_arrival_order_holds_inside_a_class():
    q = FairQueue()
    for rid, priority in [("a", 0), ("b", 5), ("c", -3), ("d", 0), ("e", 5), ("f", -3)]:
        q.add(rid, priority)
    assert drain(q) == ["c", "f", "a", "d", "b", "e"]


def test_a_request_added_later_at_a_higher_priority_goes_before_the_waiting_ones():
    q = FairQueue()
    q.add("low1", 1)
    q.add("low2", 1)
    assert drain(q, 1) == ["low1"]
    q.add("urgent", -1)
    assert list(q) == ["urgent", "low2"]


def test_a_retry_goes_to_the_front_of_its_class_only():
    q = FairQueue()
    for rid, priority in [("hi", -1), ("a", 0), ("b", 0)]:
        q.add(rid, priority)
    drain(q, 2)  # hi, a started
    q.readd("a")  # a's instance died
    assert list(q) == ["a", "b"]
    q.add("hi2", -1)
    assert list(q) == ["hi2", "a", "b"]


def test_a_cancelled_request_leaves_and_forget_drops_its_key():
    q = FairQueue()
    q.add("a")
    q.add("b")
    q.remove("a")
    assert list(q) == ["b"] and "a" not in q and q.key("a").arrival == 0
    q.forget("a")
    with pytest.raises(KeyError):
        q.key("a")


@pytest.mark.parametrize("weights", [(1.0, 1.0), (3.0, 1.0), (1.0, 2.5)])
def test_a_flooding_tenant_leaves_the_other_its_weighted_share(weights):
    """Tenant A queues 200 requests, then B 50: among every prefix of the started requests while
    both wait, |served_a / w_a - served_b / w_b| <= 1 / w_a + 1 / w_b (the module's bound)."""
    wa, wb = weights
    q = FairQueue()
    for i in range(200):
        q.add(f"a{i}", 0, "A", wa)
    drain(q, 7)  # A alone ran a while
    for i in range(50):
        q.add(f"b{i}", 0, "B", wb)
    served = {"a": 0, "b": 0}
    while any(rid.startswith("b") for rid in q):
        served[drain(q, 1)[0][0]] += 1
        gap = abs(served["a"] / wa - served["b"] / wb)
        assert gap <= 1 / wa + 1 / wb + 1e-9, (served, weights)  # the bound is reached: float rounding only
    assert served["b"] == 50


def test_a_tenant_idle_for_a_while_gets_no_credit_for_it():
    q = FairQueue()
    for i in range(10):
        q.add(f"a{i}", 0, "A")
        q.add(f"b{i}", 0, "B")
    drain(q)  # both served 10
    for i in range(10, 30):
        q.add(f"a{i}", 0, "A")
    drain(q, 15)  # B idle meanwhile
    for i in range(10, 20):
        q.add(f"b{i}", 0, "B")
    first = drain(q, 6)
    assert sorted(r[0] for r in first) == ["a", "a", "a", "b", "b", "b"], first


def test_fair_share_is_kept_per_class():
    q = FairQueue()
    for i in range(5):
        q.add(f"a{i}", 0, "A")
    q.add("b-urgent", -1, "B")
    q.add("b0", 0, "B")
    assert drain(q, 3) == ["b-urgent", "a0", "b0"]


def test_tenant_policies_bound_and_default_the_priority():
    key = "sk-test-0123456789"
    other = "sk-other-0123456789"
    tenants = Tenants(
        [f"{key}:priority=5,min=0,max=10,weight=2", "*:max=0"],
        [key, other],
        {k: tenant_of_key(k.encode()) for k in (key, other)},
    )
    mine, theirs = tenant_of_key(key.encode()), tenant_of_key(other.encode())
    assert tenants.priority(None, mine) == 5 and tenants.priority(0, mine) == 0
    assert tenants.policy(mine).weight == 2.0 and tenants.policy(theirs).weight == 1.0
    assert tenants.priority(None, theirs) == 0 and tenants.priority(-100, theirs) == -100
    with pytest.raises(InvalidParam) as e:
        tenants.priority(-1, mine)
    assert e.value.field == "priority" and e.value.value == -1 and "between 0 and 10" in e.value.rule
    with pytest.raises(InvalidParam, match="between -100 and 0"):
        tenants.priority(3, theirs)


@pytest.mark.parametrize(
    "spec, error",
    [
        ("*:priority=5,max=3", "must hold"),
        ("*:weight=0", "positive"),
        ("*:speed=3", "each part is one of"),
        ("*:min=-101", "inside -100..100"),
        ("sk-not-a-key-1234:max=3", "neither one of the API keys"),
    ],
)
def test_a_bad_policy_is_refused_naming_it_without_the_key(spec, error):
    with pytest.raises(ValueError, match=error) as e:
        Tenants([spec], [], {})
    assert "sk-not-a-key" not in str(e.value)


def test_a_policy_may_name_a_tenant_id_and_defaults_its_priority_inside_its_bounds():
    name, policy = parse_policy("key-0123456789abcdef:min=3")
    assert name == "key-0123456789abcdef" and policy.priority == 3 and policy.max_priority == 100


def test_started_requests_are_counted_per_tenant_and_exported_once_each():
    from triptych.control.metrics import Metrics

    q = FairQueue()
    for i in range(3):
        q.add(f"a{i}", 0, "key-a")
    q.add("b0", 0, "key-b")
    q.add("b1", 0, "key-b")
    q.remove("b1")  # cancelled before it started: not served
    drain(q, 3)
    assert q.served == {"key-a": 2, "key-b": 1}
    metrics = Metrics()
    metrics.update_from_describe({"tenants": {"generation": dict(q.served)}})
    drain(q)
    metrics.update_from_describe({"tenants": {"generation": dict(q.served)}})  # cumulative: the delta is added
    value = metrics.registry.get_sample_value
    assert value("triptych_tenant_requests_started_total", {"tenant": "key-a", "kind": "generation"}) == 3
    assert value("triptych_tenant_requests_started_total", {"tenant": "key-b", "kind": "generation"}) == 1
