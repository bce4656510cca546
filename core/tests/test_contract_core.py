"""The contract's bookkeeping written once (`attnres_core.dispatch`): the forcing nests, restores
on an exception and is per thread; the record counts every call under threads at once and hands
out copies; the two refusal rules (automatic choice, forcing) keep `refused` a prefix of the
preference order; bad arguments raise naming them."""

from __future__ import annotations

import threading

import pytest
from attnres_core import dispatch

NAMES = ("fast", "medium", "slow")


def test_forcing_nests_restores_and_is_per_thread():
    reg = dispatch.Registry("test_backend", NAMES)
    assert reg.forced() is None
    with reg.forcing("medium"):
        assert reg.forced() == "medium"
        with reg.forcing(("fast", {"tile": 4})):
            assert reg.forced() == ("fast", {"tile": 4})
        assert reg.forced() == "medium"
        seen = []
        thread = threading.Thread(target=lambda: seen.append(reg.forced()))
        thread.start()
        thread.join()
        assert seen == [None]  # a new thread starts in the automatic choice
        with pytest.raises(RuntimeError), reg.forcing("slow"):
            raise RuntimeError("inside")
        assert reg.forced() == "medium"
    assert reg.forced() is None


def test_auto_takes_the_first_that_takes_the_call_with_every_refusal_before_it():
    reg = dispatch.Registry("test_backend", NAMES)
    asked = []

    def reason_of(name):
        asked.append(name)
        return {"fast": "too small", "medium": None}.get(name, "never")

    assert reg.auto(reason_of) == ("medium", (("fast", "too small"),))
    assert asked == ["fast", "medium"]  # stops at the first that takes it
    asked.clear()
    assert reg.auto(reason_of, {"fast": "forced, fell back"}) == ("medium", (("fast", "forced, fell back"),))
    assert asked == ["medium"]  # a given refusal is not asked again
    assert reg.auto(lambda name: f"no {name}") == (None, tuple((n, f"no {n}") for n in NAMES))


def test_refused_before_lists_the_unforced_ones_and_a_fallback_reason():
    reg = dispatch.Registry("test_backend", NAMES)
    assert reg.refused_before("fast", "use_impl('fast')") == ()
    assert reg.refused_before("slow", "use_impl('medium')", {"medium": "no merge kernel"}) == (
        ("fast", "not forced (use_impl('medium'))"), ("medium", "no merge kernel"))
    for impl in NAMES:  # the rule: refused names + impl is a prefix of the preference order
        refused = reg.refused_before(impl, "impl='x'")
        assert [n for n, _ in refused] + [impl] == list(NAMES[:NAMES.index(impl) + 1])


def test_record_counts_every_call_from_threads_and_returns_copies():
    reg = dispatch.Registry("test_backend", NAMES)
    assert reg.last_choice() is None and reg.last_impl() is None and reg.impl_counts() == {}
    choice = dispatch.Choice("merge_partial", "slow", (("fast", "a"), ("medium", "b")))
    assert reg.record(choice) is choice
    assert reg.last_choice() == choice and reg.last_impl() == "slow"

    def many():
        for _ in range(500):
            reg.record(dispatch.Choice("depth_attention", "fast"))

    threads = [threading.Thread(target=many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = reg.impl_counts()
    assert counts == {"fast": 2000, "slow": 1}
    counts["fast"] += 1
    assert reg.impl_counts()["fast"] == 2000  # a copy
    other = dispatch.Registry("other_backend", NAMES)
    assert other.impl_counts() == {} and other.last_choice() is None  # registries share nothing


def test_choice_fields_and_bad_arguments():
    assert dispatch.Choice._fields == ("op", "impl", "refused")
    assert dispatch.Choice("depth_attention", "fast").refused == ()
    assert dispatch.OPS == ("depth_attention", "depth_attention_multi", "merge_partial")
    reg = dispatch.Registry("test_backend", NAMES)
    with pytest.raises(ValueError, match=r"choice.impl: expected one of \('fast', 'medium', 'slow'\), got 'gpu'"):
        reg.record(dispatch.Choice("depth_attention", "gpu"))
    for bad in ((), ("a", "a"), ("a", 3)):
        with pytest.raises(ValueError, match="implementations: expected distinct names"):
            dispatch.Registry("test_backend", bad)
