"""The worker's method objects per (namespace, method), bounded (kvcmas.serve.method_states)."""

from __future__ import annotations

import pytest

from kvcmas.methods import make_method
from kvcmas.serve.method_states import MethodStates


def test_one_object_per_namespace_and_method_least_recently_used_dropped():
    made = []

    def make(name):
        made.append(name)
        return make_method(name)

    states = MethodStates(make, capacity=2)
    a = states.get("t1", "kvcmas")
    assert states.get("t1", "kvcmas") is a and made == ["kvcmas"]  # kept, not made again
    b = states.get("t2", "kvcmas")
    assert b is not a  # tenants share nothing
    states.get("t1", "kvcmas")  # t1 used last: t2 is now the least recently used
    states.get("t3", "fullshared")
    assert len(states) == 2 and states.dropped == 1
    assert states.get("t1", "kvcmas") is a
    assert states.get("t2", "kvcmas") is not b  # dropped: a new tenant's cold start
    assert [key for key, _ in states.items()] == [("t1", "kvcmas"), ("t2", "kvcmas")]


def test_a_bound_below_one_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        MethodStates(make_method, capacity=0)
