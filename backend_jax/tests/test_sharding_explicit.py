"""Explicit mesh axes (`jax.make_mesh`'s default since jax 0.9, issue 43): the ops' forward and
backward (XLA and interpreted Pallas) and the scanned stack on an 8-device host mesh with the
sources sharded over the batch (data parallel) and over batch and channels (tensor parallel), equal
to the unsharded step in value and every gradient (random cotangents), results typed as the
sources.  A subprocess: the device count must be set before JAX initializes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from jax_helpers import host_devices_env

SCRIPT = textwrap.dedent(r'''
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P, AxisType
    from attnres_core.config import ResidualConfig
    from attnres_jax import depth_attention, merge_partial, scan_apply, dispatch

    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(0)
    arr = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    B, T, D = 4, 2, 8
    xs, q, g = [arr(B, T, D) for _ in range(3)], arr(D), arr(D)
    config = ResidualConfig.variant("block", block_size=2)
    params = {k: arr(*s) * 0.5 for k, s in config.param_shapes(4, D).items()}
    ws = arr(4, D, D) / 3

    def check(name, f, args, specs, out_specs):
        outs = jax.eval_shape(f, *args)
        cts = [arr(*o.shape) for o in outs]
        def loss(args, cts):
            return sum(jnp.sum(o * c) for o, c in zip(f(*args), cts))
        step = jax.jit(jax.value_and_grad(loss))
        want = step(args, cts)
        with jax.set_mesh(mesh):
            got = step(tuple(map(jax.device_put, args, specs)), [jax.device_put(c, s) for c, s in zip(cts, out_specs)])
            typed = jax.jit(f)(*tuple(map(jax.device_put, args, specs)))
        for o, s in zip(typed, out_specs):
            assert o.sharding.spec == s, (name, o.sharding.spec, s)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            err = float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) / max(1e-30, float(np.max(np.abs(b))))
            assert err < 1e-5, (name, err)
        print("ok", name)

    for sname, tok, ch in [("dp", P("dp", None, None), None), ("dp+tp", P("dp", None, "tp"), "tp")]:
        rep = P(ch)
        for impl in ("xla", "pallas"):
            ctx = dispatch.use_impl("pallas", interpret=True) if impl == "pallas" else dispatch.use_impl("xla")
            with ctx:
                check(f"{sname} {impl} depth_attention", lambda xs, q, g: depth_attention(xs, q, g, return_lse=True),
                      (xs, q, g), ([tok] * 3, rep, rep), (tok, P("dp", None)))
                check(f"{sname} {impl} merge_partial", lambda o, l, p, q, g: merge_partial(o, l, p, q, g, return_lse=True),
                      (xs[0], arr(B, T), xs[1], q, g), (tok, P("dp", None), tok, rep, rep), (tok, P("dp", None)))
        check(f"{sname} scan_apply block", lambda p, e, w: (scan_apply(config, p, e, [lambda w, h: jnp.tanh(h @ w)], w),),
              (params, xs[0], ws), (P(), tok, P(None, None, ch)), (tok,))
    print("EXPLICIT-OK")
''')


@pytest.mark.heavy
def test_explicit_axes_data_and_tensor_parallel():
    env = host_devices_env(8)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "EXPLICIT-OK" in proc.stdout
