"""Per-session values of a method object: never crossing sessions, bounded, the current kept."""

import pytest
import torch

from kvcmas.methods.session_state import SessionState


def tensor(n_bytes: int) -> torch.Tensor:
    return torch.zeros(n_bytes, dtype=torch.uint8)


def test_bound_zero_keeps_only_the_current_session():
    state = SessionState()
    state.put("a", "x", tensor(10))
    state.enter("b")  # a new session's hop starts: the last one's values go
    assert state.get("a", "x") is None and state.nbytes() == 0 and state.dropped_sessions == 1


def test_recent_sessions_are_kept_within_the_bound_least_recent_dropped_first():
    state = SessionState(max_bytes=25)
    for session in ("a", "b"):
        state.put(session, "x", tensor(10))
    state.enter("a")  # a is now more recent than b
    state.put("c", "x", tensor(10))  # 30 bytes > 25: b, the least recent, goes
    assert state.get("b", "x") is None
    assert state.get("a", "x") is not None and state.get("c", "x") is not None
    assert state.nbytes() == 20 and state.sessions() == 2


def test_values_never_cross_sessions_and_replacing_a_value_counts_once():
    state = SessionState(max_bytes=100)
    state.put("a", "x", tensor(10))
    assert state.get("b", "x") is None
    state.put("a", "x", tensor(30))
    assert state.nbytes() == 30


def test_the_current_session_is_kept_over_the_bound():
    state = SessionState(max_bytes=5)
    state.put("a", "x", tensor(10))
    state.put("a", "y", tensor(10))
    assert state.nbytes() == 20 and state.get("a", "x") is not None


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        SessionState(-1)
