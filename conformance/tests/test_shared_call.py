"""`forward_in_gradient_call`: a backend that declares it (JAX's adapter) gets one call per
gradient case, and the forward cell still reports the forward's own status: wrong outputs fail
it, and a backward that raises neither hides a working forward nor skips a broken one."""

import dataclasses

import adapters
import numpy as np
from attnres_conformance import cases
from attnres_conformance.reference_backend import ReferenceBackend
from attnres_conformance.runner import run_case

CASE = "depth_attention/base/N5-T3-D16/float64"
PROBE = "probe/full/L5-D8-T2x3/float64"


class Counting(ReferenceBackend):
    """The reference, counting its calls (with and without cotangents)."""

    forward_in_gradient_call = True

    def __init__(self):
        super().__init__()
        self.calls = []

    def call_op(self, call):
        self.calls.append(call.cotangents is not None)
        return super().call_op(call)

    def call_probe(self, call):
        self.calls.append(call.cotangent is not None)
        return super().call_probe(call)


class WrongOutShared(Counting):
    """Shares the call and returns `out` off by 1 %: the forward cell must fail."""

    def call_op(self, call):
        result = super().call_op(call)
        return dataclasses.replace(result, outputs=dict(result.outputs, out=np.asarray(result.outputs["out"]) * 1.01))


class RaisingBackward(Counting):
    """Shares the call, and its backward raises: the forward is judged by a call of its own."""

    def __init__(self, broken_forward=False):
        super().__init__()
        self.broken_forward = broken_forward

    def call_op(self, call):
        if call.cotangents is not None:
            self.calls.append(True)
            raise RuntimeError("backward not implemented")
        result = super().call_op(call)
        if self.broken_forward:
            result = dataclasses.replace(result, outputs=dict(result.outputs, out=np.asarray(result.outputs["out"]) + 1))
        return result


def test_one_call_per_gradient_case_and_both_cells_pass():
    backend = Counting()
    for case_id in (CASE, PROBE):
        backend.calls.clear()
        result = run_case(backend, cases.get_case(case_id))
        assert result.forward.status == "pass" and result.gradient.status == "pass"
        assert backend.calls == [True], (case_id, backend.calls)
    backend.forward_in_gradient_call = False  # the default: a forward call, then a gradient call
    backend.calls.clear()
    run_case(backend, cases.get_case(CASE))
    assert backend.calls == [False, True]


def test_wrong_outputs_fail_the_forward_cell_of_a_shared_call():
    backend = WrongOutShared()
    result = run_case(backend, cases.get_case(CASE))
    assert backend.calls == [True]
    assert result.forward.status == "fail" and "out" in result.forward.message
    assert result.gradient.status == "pass"  # a gradient cell judges the gradients only (they are right)


def test_a_raising_backward_leaves_the_forward_judged_on_its_own():
    backend = RaisingBackward()
    result = run_case(backend, cases.get_case(CASE))
    assert backend.calls == [True, False, True]  # shared call raised; then forward, then gradient
    assert result.forward.status == "pass"
    assert result.gradient.status == "fail" and "raised RuntimeError" in result.gradient.message
    broken = RaisingBackward(broken_forward=True)
    result = run_case(broken, cases.get_case(CASE))
    assert result.forward.status == "fail" and result.gradient.status == "fail"


def test_the_rounding_meta_adapter_is_unaffected():
    """Backends that do not declare it keep two calls (the honest low-precision port passes)."""
    result = run_case(adapters.rounding, cases.get_case(CASE.replace("float64", "bfloat16")))
    assert result.forward.status == "pass" and result.gradient.status == "pass"
