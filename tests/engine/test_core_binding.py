"""Where the engine process's OpenMP threads run (QWENSERVE_CPU_OMP_THREADS_BIND)."""

from __future__ import annotations

import pytest

from qwenserve.engine.core_binding import Binding, parse_cores, plan_binding


def test_auto_leaves_one_core_to_the_api_process_when_there_are_four_or_more():
    assert plan_binding("auto", list(range(8))) == Binding(tuple(range(7)), 7)
    assert plan_binding("auto", [0, 1]) == Binding(None, 2)  # two cores: no reservation


def test_all_nobind_list_and_tensor_parallel():
    assert plan_binding("all", [0, 1, 2]) == Binding((0, 1, 2), 3)
    assert plan_binding("nobind", [0, 1, 2]) == Binding(None, None)
    assert plan_binding("0-1,3", [0, 1, 2, 3]) == Binding((0, 1, 3), 3)
    assert plan_binding("all", [0, 1, 2, 3], tensor_parallel_size=2) == Binding(None, None)
    assert "pinned to cores 0-1,3" in Binding((0, 1, 3), 3).describe()


def test_bad_specs_name_the_variable_and_the_fix():
    with pytest.raises(ValueError, match="core list such as 0-3,6"):
        parse_cores("zero")
    with pytest.raises(ValueError, match=r"core\(s\) \[9\] are not usable"):
        plan_binding("0,9", [0, 1])


def test_unpinned_threads_wait_passively_unless_the_user_chose(monkeypatch):
    import os

    from qwenserve.engine.core_binding import apply_binding

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    apply_binding(Binding(None, 2))
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    apply_binding(Binding(None, 2))
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
