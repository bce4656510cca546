"""The public backend contract in `attnres_torch.dispatch` (IMPLEMENTATIONS, availability,
use_impl, Choice, last_choice, impl_counts, capabilities) and the flat kernel path: from the
public op to a kernel at most 3 files on the stack, none entered twice."""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import attnres_torch as at
import pytest
import torch
from attnres_torch import dispatch
from attnres_torch.kernels import chunked, composite, cpu_c

needs_c = pytest.mark.skipif(not cpu_c.available(), reason=f"no C kernel: {cpu_c.unavailable_reason()}")


def test_contract_names_and_types():
    assert dispatch.IMPLEMENTATIONS == ("triton", "cpu_c", "chunked", "composite")
    avail = dispatch.availability()
    assert tuple(avail) == dispatch.IMPLEMENTATIONS
    assert avail["chunked"] is None and avail["composite"] is None
    assert (avail["cpu_c"] is None) == cpu_c.available()
    for reason in avail.values():
        assert reason is None or (isinstance(reason, str) and reason and "\n" not in reason)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        assert avail["triton"] == "no CUDA device"
    caps = dispatch.capabilities()
    assert set(caps) == {"dtypes", "devices", "fused_kernel", "deterministic"}
    assert set(caps["dtypes"]) == {"float64", "float32", "float16", "bfloat16"}
    assert caps["devices"] == (("cpu", "cuda") if torch.cuda.is_available() else ("cpu",))
    assert caps["deterministic"] is True
    if not torch.cuda.is_available():
        assert caps["fused_kernel"] == cpu_c.available()
    assert dispatch.Choice._fields == ("op", "impl", "refused")


@needs_c
def test_last_choice_names_the_implementation_and_every_refusal_before_it():
    x, q = torch.randn(4, 8), torch.randn(8)
    at.depth_attention([x, x + 1], q)
    choice = dispatch.last_choice()
    assert choice == dispatch.Choice("depth_attention", "cpu_c", (("triton", choice.refused[0][1]),))
    assert "CUDA" in choice.refused[0][1] and at.last_impl() == "cpu_c"
    strided = torch.randn(4, 16)[:, ::2]  # stride 2 along D: the C kernel refuses
    at.depth_attention([strided, strided], q)
    choice = dispatch.last_choice()
    assert choice.impl == "chunked" and [n for n, _ in choice.refused] == ["triton", "cpu_c"]
    assert "unit stride" in choice.refused[1][1]
    at.depth_attention_multi([x.double()], q[None].double())
    choice = dispatch.last_choice()
    assert choice.op == "depth_attention_multi" and choice.impl == "composite"
    assert [n for n, _ in choice.refused] == ["triton", "cpu_c", "chunked"]
    out1, lse1 = at.depth_attention_multi([x], q[None])
    at.merge_partial(out1[0], lse1[0], x, q.requires_grad_(True))
    choice = dispatch.last_choice()
    assert choice.op == "merge_partial" and choice.impl == "composite"
    assert "gradients" in dict(choice.refused)["cpu_c"]
    assert "no merge_partial kernel" in dict(choice.refused)["chunked"]


def test_impl_counts_count_each_served_call():
    x, q = torch.randn(4, 8), torch.randn(8)
    before = dispatch.impl_counts()
    with at.use_impl("chunked"):
        at.depth_attention([x], q)
        at.depth_attention([x], q)
    with at.use_impl("composite"):
        at.depth_attention([x], q)
    diff = dispatch.impl_counts() - before
    assert diff == {"chunked": 2, "composite": 1}
    # forced: every implementation before the forced one is listed as passed over (the core's rule)
    not_forced = "not forced (use_impl('composite'))"
    assert dispatch.last_choice() == dispatch.Choice(
        "depth_attention", "composite", (("triton", not_forced), ("cpu_c", not_forced), ("chunked", not_forced)))
    with at.use_impl("chunked"):
        at.depth_attention([x], q)
    assert dispatch.last_choice().refused == (("triton", "not forced (use_impl('chunked'))"),
                                              ("cpu_c", "not forced (use_impl('chunked'))"))


def test_use_impl_auto_unknown_names_options_and_forced_refusals():
    x, q = torch.randn(4, 8), torch.randn(8)
    with at.use_impl("composite"):
        with at.use_impl("auto"):
            assert dispatch.forced() is None
            at.depth_attention([x], q)
            assert at.last_impl() != "composite" or not cpu_c.available()
        assert dispatch.forced() == "composite"
    with pytest.raises(ValueError, match=r"impl: expected one of \('triton', 'cpu_c'"):
        with at.use_impl("fast"):
            pass
    with pytest.raises(TypeError, match="take no options.*interpret"):
        with at.use_impl("triton", interpret=True):
            pass
    with at.use_impl("chunked"), pytest.raises(
            ValueError, match=r"impl: 'chunked' was forced but cannot take this depth_attention "
                              r"call: .*num_heads=1"):
        at.depth_attention([x], q, num_heads=2)
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        with at.use_impl("triton"), pytest.raises(ValueError, match="impl: 'triton'.*Triton"):
            at.depth_attention([x.to(torch.float64)], q.to(torch.float64))


def test_forced_merge_without_a_kernel_falls_back_and_says_why():
    xs, q = [torch.randn(4, 8) for _ in range(2)], torch.randn(8)
    with torch.no_grad():
        out1, lse1 = at.depth_attention_multi(xs, q[None])
        with at.use_impl("chunked"):
            at.merge_partial(out1[0], lse1[0], xs[0], q)
    choice = dispatch.last_choice()
    assert choice.impl == "composite" and [n for n, _ in choice.refused] == ["triton", "cpu_c", "chunked"]
    assert dict(choice.refused)["cpu_c"] == "not forced (use_impl('chunked'))"
    assert "no merge_partial kernel" in dict(choice.refused)["chunked"]


def test_implementation_modules():
    assert dispatch.implementation("cpu_c") is cpu_c
    assert dispatch.implementation("chunked") is chunked
    assert dispatch.implementation("composite") is composite
    with pytest.raises(ValueError, match="impl: expected one of"):
        dispatch.implementation("nope")
    for module in (cpu_c, chunked):
        assert module.NAME in dispatch.IMPLEMENTATIONS and module.DEVICE_TYPE == "cpu"


# -- the flat path ----------------------------------------------------------------------------------

PACKAGES = {Path(at.__file__).parent, Path(sys.modules["attnres_core"].__file__).parent}


def _ours(frame) -> str | None:
    """The file of `frame` relative to its package root, when it is attnres_torch's or
    attnres_core's; None for every other file (torch's, the test's)."""
    path = Path(frame.f_code.co_filename)
    for root in PACKAGES:
        if root in path.parents:
            return f"{root.name}/{path.relative_to(root)}"
    return None


def _stack_files(frame) -> list:
    """Our files on the stack, outermost first, consecutive frames of one file collapsed."""
    files = []
    while frame is not None:
        name = _ours(frame)
        if name is not None and (not files or files[-1] != name):
            files.append(name)
        frame = frame.f_back
    return files[::-1]


def _trace(fn, kernels) -> tuple:
    """Runs `fn` under a profiler: (the stacks of our files at each call of a function in
    `kernels`, every stack of our files seen at a Python call)."""
    at_kernel, seen = [], []
    codes = {inspect.unwrap(k).__code__ for k in kernels}  # under torch.no_grad()'s wrapper

    def profile(frame, event, arg):
        if event != "call" or _ours(frame) is None:
            return
        stack = _stack_files(frame)
        seen.append(stack)
        if frame.f_code in codes:
            at_kernel.append(stack)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return at_kernel, seen


@pytest.mark.parametrize("impl", ["cpu_c", "chunked"])
def test_public_call_reaches_the_kernel_through_at_most_three_files(impl):
    """ops.py (the checks) -> dispatch.py (the choice, then the run) -> the implementation
    module: on the stack at the kernel, those three files; no file appears twice on any stack
    (nothing calls back into a file it came from).  The backward: dispatch.py's autograd formula
    -> the implementation's backward op."""
    if impl == "cpu_c" and not cpu_c.available():
        pytest.skip(f"no C kernel: {cpu_c.unavailable_reason()}")
    module = {"cpu_c": cpu_c, "chunked": chunked}[impl]
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
    q = torch.randn(8, requires_grad=True)
    with at.use_impl(impl):
        stacks, seen = _trace(lambda: at.depth_attention(xs, q), [module.forward_into])
        out = at.depth_attention(xs, q)
    root = f"attnres_torch/kernels/{impl}.py"
    assert stacks == [["attnres_torch/ops.py", "attnres_torch/dispatch.py", root]], stacks
    assert all(len(s) == len(set(s)) for s in seen), [s for s in seen if len(s) != len(set(s))]
    d_out = torch.randn_like(out)
    stacks, seen = _trace(lambda: out.backward(d_out), [module.backward_into])
    assert stacks == [["attnres_torch/dispatch.py", root]], stacks
    assert all(len(s) == len(set(s)) for s in seen)
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in xs)


def _imports(path: Path) -> set:
    import ast

    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.update(f"{base}.{a.name}" if not node.module else base for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_no_implementation_imports_another_or_the_registry():
    """Each implementation module owns its path: it imports neither another implementation nor
    `dispatch` nor `ops` (the shared leaf helpers `_args` and `_rows` only; `dispatch` registers
    their custom ops)."""
    root = Path(at.__file__).parent
    others = {"cpu_c", "chunked", "composite", "dispatch", "ops", "triton_depth"}
    for rel in ("kernels/cpu_c.py", "kernels/chunked.py", "kernels/triton_depth.py",
                "kernels/composite.py"):
        own = Path(rel).stem
        imported = _imports(root / rel)
        bad = {i for i in imported for o in others - {own} if i.rstrip(".").split(".")[-1] == o}
        assert not bad, (rel, bad)


def test_the_front_door_names_no_implementation_and_no_private_torch_api():
    """ops.py checks arguments and dispatches: no implementation module (the kernels, the
    composition), no kernel function and no `torch._C` symbol appear in it; the repeated-call
    plans and the eager hook live in plans.py, the runs in dispatch.py (issue 41)."""
    import re

    source = Path(at.ops.__file__).read_text()
    code = re.sub(r'""".*?"""|#[^\n]*', "", source, flags=re.S)  # docstrings and comments aside
    assert "def depth_attention(" in code and "def merge_partial(" in code
    names = set(at.dispatch.IMPLEMENTATIONS) | {"composite", "triton_depth", "kernels"}
    found = sorted(n for n in names if re.search(rf"\b{n}\b", code))
    assert found == [], found
    assert "torch._C" not in code and "_eager" not in code and "forward_ad" not in code


# -- the walk's returns (issue 41: "a call's walk has <= 3 returns") ---------------------------------

TORCH_ROOT = Path(at.__file__).parent


def _torch_file(frame) -> str | None:
    path = Path(frame.f_code.co_filename)
    return str(path.relative_to(TORCH_ROOT)) if TORCH_ROOT in path.parents else None


def _returns(fn) -> list:
    """Runs `fn` under sys.setprofile: every return from a frame in an attnres_torch file A to its
    caller frame (`f_back`) in a different attnres_torch file B, as "A:function -> B" (frames of
    other files, torch's dispatcher and attnres_core's included, are not counted)."""
    found = []

    def profile(frame, event, arg):
        if event != "return" or frame.f_back is None:
            return
        here, there = _torch_file(frame), _torch_file(frame.f_back)
        if here is not None and there is not None and here != there:
            found.append(f"{here}:{frame.f_code.co_name} -> {there}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return found


def _public_calls(grad: bool) -> dict:
    xs = [torch.randn(4, 8, requires_grad=grad) for _ in range(3)]
    q, g = torch.randn(8, requires_grad=grad), torch.rand(8) + 0.5
    qs = torch.randn(2, 8, requires_grad=grad)
    with torch.no_grad():
        out1, lse1 = at.depth_attention_multi(xs, qs)
    partial = torch.randn(4, 8, requires_grad=grad)
    return {"depth_attention": lambda: at.ops.depth_attention(xs, q, g),
            "depth_attention_multi": lambda: at.ops.depth_attention_multi(xs, qs),
            "merge_partial": lambda: at.ops.merge_partial(out1[0], lse1[0], partial, q, g)}


def walk_returns(impl: str) -> dict:
    """(op, "grad" | "no grad", "first" | "repeat") -> the returns of that public call forced onto
    `impl`: "first" with no plan kept (the checks, the choice, the run), "repeat" the same call
    again (`plans.py`)."""
    from attnres_torch import plans

    counts = {}
    for grad in (False, True):
        for op, fn in _public_calls(grad).items():
            with dispatch.use_impl(impl):
                saved = dict(plans._PLANS)
                plans._PLANS.clear()
                try:
                    counts[op, "grad" if grad else "no grad", "first"] = _returns(fn)
                    counts[op, "grad" if grad else "no grad", "repeat"] = _returns(fn)
                finally:
                    plans._PLANS.update(saved)
    return counts


#: The returns measured, (op, grad, first/repeat) -> count, per implementation: `walk_returns`
#: must not grow past them.  The first call's are mostly the argument helpers of `_args.py` and
#: the row helpers of `_rows.py` (one return each per call); a repeated call without gradient on
#: cpu_c is the kernel's row helper, its eager hook and `plans` (3); one with a gradient adds the
#: custom op's row helpers and `dispatch.run_*`.
MEASURED = {
    "cpu_c": {("depth_attention", "no grad"): (27, 3), ("depth_attention_multi", "no grad"): (20, 3),
              ("merge_partial", "no grad"): (28, 3), ("depth_attention", "grad"): (28, 11),
              ("depth_attention_multi", "grad"): (21, 6), ("merge_partial", "grad"): (20, 4)},
    "chunked": {("depth_attention", "no grad"): (23, 10), ("depth_attention_multi", "no grad"): (16, 5),
                ("merge_partial", "no grad"): (20, 4), ("depth_attention", "grad"): (24, 11),
                ("depth_attention_multi", "grad"): (17, 6), ("merge_partial", "grad"): (20, 4)},
}


def _skip_without_c(impl):
    if impl == "cpu_c" and not cpu_c.available():
        pytest.skip(f"no C kernel: {cpu_c.unavailable_reason()}")


@pytest.mark.parametrize("impl", ["cpu_c", "chunked"])
def test_walk_returns_do_not_grow(impl):
    """Every public op, with and without gradients, first and repeated call: no more returns from
    one attnres_torch file into another than `MEASURED` (what the walk is today)."""
    _skip_without_c(impl)
    counts = walk_returns(impl)
    over = {key: found for key, found in counts.items()
            if len(found) > MEASURED[impl][key[:2]][key[2] == "repeat"]}
    assert not over, over


def test_repeated_call_without_gradient_has_at_most_three_returns():
    """Issue 41's "a call's walk has <= 3 returns" for the call it measured (7 then): a repeated
    call that needs no gradient on cpu_c, every public op (the batch-1 decode read)."""
    _skip_without_c("cpu_c")
    counts = walk_returns("cpu_c")
    over = {key: found for key, found in counts.items()
            if key[1:] == ("no grad", "repeat") and len(found) > 3}
    assert not over, over


@pytest.mark.xfail(strict=True, reason="issue 41's done-criterion is met for repeated calls without "
                                       "gradient on cpu_c only: a first call returns 16-28 times "
                                       "across attnres_torch files, a repeated one 3-11 (MEASURED)")
@pytest.mark.parametrize("impl", ["cpu_c", "chunked"])
def test_walk_has_at_most_three_returns(impl):
    """Issue 41: "a call's walk has <= 3 returns", for every public op on cpu_c and chunked."""
    _skip_without_c(impl)
    counts = walk_returns(impl)
    assert all(len(found) <= 3 for found in counts.values()), {k: len(v) for k, v in counts.items()}


if __name__ == "__main__":  # prints the measured walks
    for impl in ("cpu_c", "chunked"):
        for key, found in walk_returns(impl).items():
            print(impl, *key, len(found), found)
