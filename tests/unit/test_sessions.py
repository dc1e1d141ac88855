"""The head's challenge and session tables are bounded, the oldest forgotten first."""

from triptych.control.sessions import SessionTable


def test_outstanding_challenges_are_bounded_oldest_forgotten_first():
    table = SessionTable(max_pending=2)
    nonces = {ident: table.challenge(ident, f"w-{ident.decode()}", now=0.0) for ident in (b"a", b"b", b"c")}
    assert "no challenge outstanding" in table.admit(b"a", nonces[b"a"], "w-a", now=1.0)
    assert table.admit(b"b", nonces[b"b"], "w-b", now=1.0) is None
    assert table.admit(b"c", nonces[b"c"], "w-c", now=1.0) is None


def test_a_socket_asking_again_gets_a_fresh_challenge_and_the_old_one_is_void():
    table = SessionTable(max_pending=2)
    first = table.challenge(b"a", "w-a", now=0.0)
    second = table.challenge(b"a", "w-a", now=0.0)
    table.challenge(b"b", "w-b", now=0.0)  # two outstanding: a's second, b's: a's is still there
    assert "another challenge" in table.admit(b"a", first, "w-a", now=1.0)
    again = table.challenge(b"a", "w-a", now=0.0)
    assert second != again and table.admit(b"a", again, "w-a", now=1.0) is None
