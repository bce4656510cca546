"""The public backend contract of `attnres_jax.dispatch` (the same names in every backend) and the
flat path from a public call to a kernel: at the kernel the package's frames span ops.py ->
dispatch.py -> one implementation module, no file twice, and the leaf helpers (`_args`, `_math`)
call nothing back."""

from __future__ import annotations

import collections
import os
import sys

import attnres_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attnres_jax import depth_attention, depth_attention_multi, dispatch, merge_partial
from attnres_jax.kernels import pallas as kernels
from attnres_numpy import ops as ref
from jax_helpers import assert_close

D = 8
CPU = jax.default_backend() == "cpu"
PKG = os.path.dirname(attnres_jax.__file__) + os.sep
LEAVES = ("_args.py", "_math.py")


def _xs(rng, n=3, tokens=(5,)):
    return [jnp.asarray(rng.standard_normal(tokens + (D,)), jnp.float32) for _ in range(n)]


# -- the contract --------------------------------------------------------------------------------------


def test_names_and_availability():
    assert dispatch.IMPLEMENTATIONS == ("pallas", "xla") == tuple(dispatch.REGISTRY)
    avail = dispatch.availability()
    assert tuple(avail) == dispatch.IMPLEMENTATIONS and avail["xla"] is None
    if CPU:
        assert "gpu/tpu only" in avail["pallas"] and "\n" not in avail["pallas"]
    caps = dispatch.capabilities()
    assert set(caps) == {"dtypes", "devices", "fused_kernel", "deterministic"}
    assert caps["dtypes"] == ("float64", "float32", "float16", "bfloat16") and caps["deterministic"] is True
    assert caps["devices"][0] == jax.default_backend() and "cpu" in caps["devices"]
    assert caps["fused_kernel"] is (avail["pallas"] is None)
    assert dispatch.Choice._fields == ("op", "impl", "refused")


def test_auto_choice_is_recorded_with_the_refusals(rng):
    xs, q = _xs(rng), jnp.ones(D)
    before = dispatch.impl_counts()
    depth_attention(xs, q)
    choice = dispatch.last_choice()
    want = "pallas" if dispatch.availability()["pallas"] is None else "xla"
    assert choice.op == "depth_attention" and choice.impl == want
    if want == "xla":
        assert choice.refused == (("pallas", dispatch.availability()["pallas"]),)
    assert dispatch.impl_counts() - before == collections.Counter({want: 1})
    depth_attention(xs, q, num_heads=2)  # no kernel has heads: refused with the reason
    assert dispatch.last_choice() == ("depth_attention", "xla", (("pallas", "the kernels have one head (num_heads=1)"),))
    f = jax.jit(lambda xs: merge_partial(xs[0], jnp.zeros(5), xs[1], q))
    f(xs)
    assert dispatch.last_choice().op == "merge_partial"
    counted = dispatch.impl_counts()
    f(xs)  # a cached trace calls no op: nothing recorded
    assert dispatch.impl_counts() == counted
    counted["xla"] += 1000  # impl_counts returns a copy
    assert dispatch.impl_counts() != counted


def test_forced_implementations(rng):
    xs, q = _xs(rng), jnp.ones(D)
    with dispatch.use_impl("xla"):
        depth_attention_multi(xs, jnp.stack([q, q]))
    assert dispatch.last_choice() == ("depth_attention_multi", "xla", (("pallas", "not forced (use_impl('xla'))"),))
    depth_attention(xs, q, impl="xla")
    assert dispatch.last_choice().refused == (("pallas", "not forced (impl='xla')"),)
    kernels.CALLS.clear()
    with dispatch.use_impl("pallas", interpret=True, tile=4, poison=True):
        out = depth_attention(xs, q)
        assert dispatch.last_choice() == ("depth_attention", "pallas", ())
        with pytest.raises(ValueError, match=r"use_impl\('pallas'\) cannot run this depth_attention call: "
                                             r"the kernels have one head"):
            depth_attention(xs, q, num_heads=2)
        with pytest.raises(ValueError, match=r"use_impl\('pallas'\) cannot run this depth_attention call: "
                                             r"a masked read \(num_valid\) runs on XLA only"):
            depth_attention(jnp.stack(xs), q, num_valid=2)
        with dispatch.use_impl("auto"):  # nests: the inner block wins, then the outer returns
            depth_attention(xs, q)
            assert dispatch.last_choice().impl == ("pallas" if not CPU else "xla")
        depth_attention(xs, q)
        assert dispatch.last_choice().impl == "pallas"
    assert set(kernels.CALLS) == {"attnres_forward"}
    assert_close(out, ref.depth_attention([np.asarray(x, np.float64) for x in xs], np.ones(D)), "float32", "out",
                 grad=False)
    if CPU:
        with dispatch.use_impl("pallas"), pytest.raises(ValueError, match=r"use_impl\('pallas'\) cannot run this "
                                                                          r"merge_partial call: no compiled"):
            merge_partial(xs[0], jnp.zeros(5), xs[1], q)
    with pytest.raises(ValueError, match=r"use_impl: expected 'auto' or one of \('pallas', 'xla'\)"):
        with dispatch.use_impl("metal"):
            pass


def test_auto_with_interpreter_options_keeps_other_calls_on_xla(rng):
    xs, q = _xs(rng), jnp.ones(D)
    with dispatch.use_impl("auto", interpret=True, tile=4):
        depth_attention(jnp.stack(xs), q, num_valid=2)
        assert dispatch.last_choice() == ("depth_attention", "xla",
                                          (("pallas", "a masked read (num_valid) runs on XLA only"),))
        merge_partial(xs[0], jnp.zeros(5), xs[1], q)
        assert dispatch.last_choice() == ("merge_partial", "pallas", ())


# -- the path from the public call to a kernel ---------------------------------------------------------


class _Path:
    """sys.setprofile recorder: the package files on the stack (outermost first, consecutive
    frames of one file merged) each time a function named `target` in file `where` is entered,
    and every call a leaf helper made into another package file (a callback its caller handed it,
    a lambda, is the caller's code, not a call back)."""

    def __init__(self, where: str, target: str):
        self.where, self.target, self.stacks, self.leaf_calls = PKG + where, target, [], []

    def __call__(self, frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(PKG):
            return
        files, caller, f = [], None, frame
        while f is not None:
            name = f.f_code.co_filename
            if name.startswith(PKG):
                if f is not frame and caller is None:
                    caller = name[len(PKG):]  # the nearest package frame below this call
                if not files or files[-1] != name[len(PKG):]:
                    files.append(name[len(PKG):])
            f = f.f_back
        if (caller is not None and caller.replace(os.sep, "/").split("/")[-1] in LEAVES
                and files[0] != caller and frame.f_code.co_name != "<lambda>"):
            self.leaf_calls.append((caller, files[0], frame.f_code.co_name))
        if frame.f_code.co_filename == self.where and frame.f_code.co_name == self.target:
            self.stacks.append(tuple(reversed(files)))

    def run(self, fn):
        sys.setprofile(self)
        try:
            return fn()
        finally:
            sys.setprofile(None)


def _norm(stack):
    return tuple(p.replace(os.sep, "/") for p in stack)


def test_kernel_path_is_ops_dispatch_implementation(rng):
    """Forward: ops.py -> dispatch.py -> kernels/pallas.py at the `pallas_call` (kernels._call);
    backward: dispatch.py (the custom VJP's rule) -> kernels/pallas.py.  Phase 1's and the
    merge's backwards, which have no kernel, run XLA's rules: dispatch.py -> kernels/xla.py."""
    xs, q = _xs(rng), jnp.asarray(rng.standard_normal(D), jnp.float32)
    path = _Path("kernels" + os.sep + "pallas.py", "_call")
    with dispatch.use_impl("pallas", interpret=True, tile=4, poison=True):
        out, pull = path.run(lambda: jax.vjp(lambda xs, q: depth_attention(xs, q), xs, q))
        path.run(lambda: pull(jnp.ones_like(out)))
    stacks = {_norm(s) for s in path.stacks}
    assert stacks == {("ops.py", "dispatch.py", "kernels/pallas.py"), ("dispatch.py", "kernels/pallas.py")}, stacks
    assert not path.leaf_calls, path.leaf_calls

    xla = _Path("kernels" + os.sep + "xla.py", "backward")
    with dispatch.use_impl("pallas", interpret=True, tile=4):
        out, pull = xla.run(lambda: jax.vjp(lambda xs, q: depth_attention_multi(xs, q)[0], xs, jnp.stack([q, q])))
        xla.run(lambda: pull(jnp.ones_like(out)))
    assert {_norm(s) for s in xla.stacks} == {("dispatch.py", "kernels/xla.py")}
    assert not xla.leaf_calls, xla.leaf_calls

    merge = _Path("kernels" + os.sep + "xla.py", "merge_backward")  # the merge kernel's backward: XLA's rule, as phase 1's
    with dispatch.use_impl("pallas", interpret=True, tile=4):
        out, pull = merge.run(lambda: jax.vjp(lambda o, p: merge_partial(o, jnp.zeros(5), p, q), xs[0], xs[1]))
        merge.run(lambda: pull(jnp.ones_like(out)))
    assert dispatch.last_choice() == ("merge_partial", "pallas", ())
    assert {_norm(s) for s in merge.stacks} == {("dispatch.py", "kernels/xla.py")}
    assert not merge.leaf_calls, merge.leaf_calls


def test_xla_path_is_ops_dispatch_xla(rng):
    xs, q = _xs(rng), jnp.ones(D)
    path = _Path("kernels" + os.sep + "xla.py", "forward")
    path.run(lambda: depth_attention(xs, q, impl="xla"))
    assert {_norm(s) for s in path.stacks} == {("ops.py", "dispatch.py", "kernels/xla.py")}
    assert not path.leaf_calls, path.leaf_calls


def test_the_pallas_implementation_does_not_import_xla():
    """The Pallas module reaches the XLA formulas only through the registry."""
    import ast

    tree = ast.parse(open(kernels.__file__).read())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not {m for m in imported if m.rsplit(".", 1)[-1] == "xla"}, imported  # `.xla` or `..kernels.xla`
    assert not hasattr(kernels, "xla")
