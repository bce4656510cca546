"""The NNX modules as a Flax user shards them (issue 43 items 1 and 2): `jax.make_mesh` with
Explicit axes (its default) and with Auto axes, mesh axis names of the user's (("dp", "tp"),
("data", "tensor"), a data-only ("batch",)), the `Transformer`'s tensor axis given as
`tensor_axis=` or mapped by `nnx.logical_axis_rules`.  One `nnx.jit` + `nnx.Optimizer` AdamW
step (forward and backward) of the unrolled and the scanned model, built under the mesh (flax
places each parameter from its metadata) and fed batch-sharded tokens, equals the unsharded
step: loss and every updated parameter; the parameters stay sharded as their metadata says and
the logits are typed as the tokens.  `DepthRouter` and `DepthAttention` under Explicit axes:
value and every gradient equal the unsharded ones.  A tensor axis that is not the mesh's is
refused at construction (and by `Transformer.shardings(mesh)`) with a message naming the fixes.  On 8 host
CPU devices, in a subprocess (the device count must be set before JAX initializes)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from jax_helpers import host_devices_env

SCRIPT = textwrap.dedent(r'''
    import re
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from jax.sharding import AxisType, PartitionSpec as P
    from attnres_core.config import ResidualConfig
    from attnres_jax.modules import DepthAttention, DepthRouter, Transformer

    assert len(jax.devices()) == 8, jax.devices()
    E, A = AxisType.Explicit, AxisType.Auto
    config = ResidualConfig.variant("block", block_size=2)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (4, 9)))
    seen = {}

    def build(scan, **kw):
        model = Transformer(config, vocab_size=32, dim=16, num_blocks=2, num_heads=4,
                            rngs=nnx.Rngs(0), scan_layers=scan, **kw)
        rows = {k: np.random.default_rng(1).standard_normal(v.shape).astype(np.float32)
                for k, v in model.router.params().items()}
        model.router.load_params(rows)  # rows that matter (zero queries: a uniform mean)
        return model

    @nnx.jit
    def step(model, opt, t):
        def loss(m):
            logits = m(t[:, :-1], scale=jnp.asarray(0.8))
            seen["logits"] = jax.typeof(logits).sharding.spec
            return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()
        value, grads = nnx.value_and_grad(loss)(model)
        opt.update(model, grads)
        return value

    def run(model, t):
        opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
        return float(step(model, opt, t)), nnx.to_flat_state(nnx.state(model, nnx.Param))

    want = {scan: run(build(scan), tokens) for scan in (False, True)}

    def spec(x):
        entries = tuple(x.sharding.spec)
        return entries + (None,) * (x.ndim - len(entries))

    def check(name, mesh, scan, batch, tp, rules=(), **kw):
        with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
            model = build(scan, **kw)
            data = jax.device_put(tokens, P(batch, None))
            loss, params = run(model, data)
        want_loss, want_params = want[scan]
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=name)
        for (path, a), (_, b) in zip(params, want_params):
            np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=2e-4, atol=2e-5,
                                       err_msg=f"{name} {path}")
        flat = dict(params)
        lead = ("blocks", "attention") if scan else ("sublayers", 0)
        stack = (None,) if scan else ()
        qkv, out = flat[lead + ("qkv", "kernel")][...], flat[lead + ("out", "kernel")][...]
        assert spec(qkv) == (*stack, None, tp), (name, qkv.sharding)
        assert spec(out) == (*stack, tp, None), (name, out.sharding)
        assert spec(flat[("embed", "embedding")][...]) == (tp, None), name
        assert flat[("router", "queries")][...].sharding.is_fully_replicated, name
        if tp is not None:
            assert qkv.addressable_shards[0].data.shape[-1] == qkv.shape[-1] // mesh.shape[tp], name
        if E in mesh.axis_types:
            assert seen["logits"] == P(batch, None, None), (name, seen["logits"])
        print("ok", name, loss)

    dp_tp = {t: jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(t, t)) for t in (E, A)}
    for t, scans in ((E, (False, True)), (A, (True,))):
        for scan in scans:
            check(f"{t} dp x tp tensor_axis scan={scan}", dp_tp[t], scan, "dp", "tp", tensor_axis="tp")
    data_tensor = jax.make_mesh((2, 4), ("data", "tensor"))  # jax.make_mesh as written: Explicit
    assert data_tensor.axis_types == (E, E), data_tensor.axis_types
    check("make_mesh default, logical_axis_rules", data_tensor, False, "data", "tensor",
          rules=[("model", "tensor")])
    batch_only = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])  # the batch is 4
    check("Explicit data parallel only (tensor_axis=None)", batch_only, True, "batch", None, tensor_axis=None)

    # the router and the depth-attention layer under Explicit axes: value and every gradient
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.router = DepthRouter(config, 4, 8)
            self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(4)])
            self.attn = DepthAttention(8, num_heads=2)

        def __call__(self, x):
            h = self.router(x, [lambda h, f=f: jnp.tanh(f(h)) for f in self.layers], scale=jnp.asarray(0.7))
            return self.attn([x, h, jnp.sin(h)])

    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 3, 8)).astype(np.float32)
    ct = rng.standard_normal((4, 3, 8)).astype(np.float32)

    def net():
        n = Net(nnx.Rngs(3))
        n.router.load_params({k: rng_r.standard_normal(v.shape).astype(np.float32)
                              for k, v in n.router.params().items()})
        n.attn.query[...] = jnp.linspace(-1, 1, 8)
        return n

    def value_grads(n, x, ct):
        return nnx.jit(nnx.value_and_grad(lambda n, x: jnp.sum(n(x) * ct)))(n, x)

    rng_r = np.random.default_rng(4)
    ref_value, ref_grads = value_grads(net(), x, ct)
    mesh = dp_tp[E]
    with jax.set_mesh(mesh):
        rng_r = np.random.default_rng(4)
        value, grads = value_grads(net(), jax.device_put(x, P("dp", None, None)), jax.device_put(ct, P("dp", None, None)))
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
    for (path, a), (_, b) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
        np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=1e-4, atol=1e-5, err_msg=str(path))
    print("ok router + depth attention under Explicit axes")

    # a tensor axis the mesh does not have: refused at once, naming both fixes
    def refused(fn, *words):
        try:
            fn()
        except ValueError as e:
            msg = str(e)
            assert all(w in msg for w in words), msg
            return msg
        raise AssertionError("not refused")

    fixes = ("tensor_axis=", "nnx.logical_axis_rules", "('dp', 'tp')")
    with jax.set_mesh(dp_tp[E]):
        refused(lambda: build(False), "'model'", *fixes)
        with nnx.logical_axis_rules([("model", "tensor")]):
            refused(lambda: build(True), "mapped to 'tensor'", *fixes)
    outside = build(False)
    refused(lambda: outside.shardings(dp_tp[A]), "'model'", *fixes)
    with nnx.logical_axis_rules([("model", "tp")]):
        shardings = outside.shardings(dp_tp[A])
    assert shardings["head"]["kernel"].spec == P(None, "tp")
    assert build(False, tensor_axis="tp").sublayers[0].qkv.kernel.get_metadata()["out_sharding"] == (None, "tp")
    print("SHARDING-MODULES-OK")
''')


@pytest.mark.heavy
def test_modules_under_user_meshes_explicit_and_auto():
    env = host_devices_env(8)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SHARDING-MODULES-OK" in proc.stdout
