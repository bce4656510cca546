"""`jit` with `NamedSharding` over batch and sequence on an 8-device host mesh (subprocess: the
device count must be set before JAX initializes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from jax_helpers import host_devices_env

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from attnres_numpy import model as ref
    from attnres_numpy import ops
    from attnres_core.config import ResidualConfig
    from attnres_jax import depth_attention, probe_forward
    from jax_helpers import assert_close  # the suite's metric and table (on PYTHONPATH below)

    assert len(jax.devices()) == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("batch", "seq"))
    tok = NamedSharding(mesh, P("batch", "seq", None))  # [B, T, D]
    rep = NamedSharding(mesh, P())
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((4, 8, 16)).astype(np.float32) for _ in range(5)]
    q, g = (rng.standard_normal(16).astype(np.float32) for _ in range(2))
    sx = [jax.device_put(x, tok) for x in xs]
    sq, sg = jax.device_put(q, rep), jax.device_put(g, rep)

    def loss(xs, q, g):
        out, lse = depth_attention(xs, q, g, return_lse=True)
        return jnp.sum(out ** 2) + jnp.sum(lse), out

    # The forward needs no communication at all: tokens stay where they are.
    hlo = jax.jit(lambda xs, q, g: depth_attention(xs, q, g)).lower(sx, sq, sg).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo and "collective-permute" not in hlo, hlo
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, out), (dx, dq, dg) = step(sx, sq, sg)
    assert out.sharding.is_equivalent_to(tok, 3), out.sharding
    assert dx[0].sharding.is_equivalent_to(tok, 3), dx[0].sharding
    x64 = [x.astype(np.float64) for x in xs]
    want_out, want_lse = ops.depth_attention(x64, q.astype(np.float64), g.astype(np.float64), return_lse=True)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    want = ops.depth_attention_vjp(x64, q.astype(np.float64), g.astype(np.float64), 2 * want_out,
                                   np.ones(want_lse.shape))
    assert_close(np.stack(dx), np.stack(want["sources"]), "float32", "d_sources", grad=True)
    assert_close(dq, want["query"], "float32", "d_query", grad=True)
    assert_close(dg, want["norm_weight"], "float32", "d_norm_weight", grad=True)

    config = ResidualConfig.variant("block", block_size=2)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in config.param_shapes(4, 16).items()}
    w = (rng.standard_normal((4, 16, 16)) / 4).astype(np.float32)
    emb = rng.standard_normal((4, 8, 16)).astype(np.float32)
    for schedule in ("direct", "two_phase"):
        f = jax.jit(lambda p, e, w: probe_forward(config, p, e, w, schedule=schedule))
        got = f(jax.device_put(params, rep), jax.device_put(emb, tok), jax.device_put(w, rep))
        assert got.sharding.is_equivalent_to(tok, 3), got.sharding
        p64 = {k: v.astype(np.float64) for k, v in params.items()}
        np.testing.assert_allclose(got, ref.probe_forward(config, p64, emb.astype(np.float64),
                                                          w.astype(np.float64)), rtol=1e-4, atol=1e-4)

    # shard_map with replicated pseudo-query and gain (check_vma on): the custom VJPs return
    # their gradients summed over the token shards, equal to the unsharded gradients.
    from attnres_jax import merge_partial
    spec_tok = P("batch", "seq", None)

    def local(xs, q, g):
        out, lse = depth_attention(xs, q, g, return_lse=True)
        merged = merge_partial(out, lse, xs[-1], q, g)
        return jnp.sum(out ** 2) + jnp.sum(lse) + jnp.sum(merged)

    sharded = jax.shard_map(lambda xs, q, g: jax.lax.psum(local(xs, q, g), ("batch", "seq")),
                            mesh=mesh, in_specs=([spec_tok] * 5, P(), P()), out_specs=P())
    got = jax.jit(jax.grad(sharded, argnums=(0, 1, 2)))(sx, sq, sg)
    # Against the same function in float64 (upcast inputs), not against a float32 fast path: the
    # float32 roundings of the two programs legitimately differ in the last bits.
    with jax.enable_x64(True):
        want = jax.grad(local, argnums=(0, 1, 2))([x.astype(np.float64) for x in xs], q.astype(np.float64),
                                                 g.astype(np.float64))
        want = [np.asarray(b) for b in jax.tree_util.tree_leaves(want)]
    names = [f"d_sources[{i}]" for i in range(5)] + ["d_query", "d_norm_weight"]
    for a, b, name in zip(jax.tree_util.tree_leaves(got), want, names):
        assert np.asarray(a).dtype == np.float32, (name, np.asarray(a).dtype)
        assert_close(np.asarray(a), b, "float32", name, grad=True)
    print("SHARDING-OK")
""")


def test_sharded_jit_over_batch_and_sequence():
    env = host_devices_env(8, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SHARDING-OK" in proc.stdout
