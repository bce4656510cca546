"""`attnres_jax.distributed` under `shard_map` on a mesh of 8 host CPU devices (a subprocess:
the device count must be set before JAX initializes): hidden-dimension sharding and the
sequence-sharded prefill equal the float64 reference and the single-device ops, forward and
every gradient; the hidden-dim psums carry 2NH (forward) and NH (backward) scalars per token."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from jax_helpers import host_devices_env, rtol_for

SCRIPT = textwrap.dedent(r'''
    import json, os
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_enable_x64", True)
    from jax.sharding import Mesh, PartitionSpec as P
    from attnres_conformance.tolerances import TOLERANCES, rel_err
    from attnres_numpy import model as ref_model, ops as ref
    from attnres_core.config import ResidualConfig
    import attnres_jax
    from attnres_jax.distributed import depth_attention_tp, sequence_sharded_prefill

    assert len(jax.devices()) == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("x",))
    results = {}

    def err(got, want):
        """The conformance suite's metric (attnres_conformance.tolerances.rel_err)."""
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert got.shape == want.shape, (got.shape, want.shape)
        return rel_err(got, want, TOLERANCES["float32"].atol)[0]

    def collectives(jaxpr, found):
        for e in jaxpr.eqns:
            name = e.primitive.name
            if any(k in name for k in ("psum", "all_gather", "reduce_scatter", "all_to_all", "ppermute")):
                found.append([name, [int(np.prod(v.aval.shape)) for v in e.invars]])
            for p in e.params.values():
                for sub in (p if isinstance(p, (list, tuple)) else [p]):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        collectives(inner, found)
        return found

    # -- hidden-dimension sharding -------------------------------------------------------------
    TP_CASES = [  # name, dtype, N, T, D, options, per-token query, gain
        ("f64_heads_cross_devices", "float64", 3, 5, 16, dict(num_heads=4), False, True),
        ("f64_sigmoid_token_query", "float64", 4, 3, 16, dict(activation="sigmoid"), True, False),
        ("f64_no_key_norm_heads", "float64", 3, 4, 16, dict(num_heads=2, key_norm=False, scale=0.5), False, True),
        ("f32_softmax", "float32", 5, 6, 32, dict(eps=1e-5), False, True),
    ]
    for name, dt, n, t, d, opts, per_token, gain in TP_CASES:
        rng = np.random.default_rng(len(name))
        xs = rng.standard_normal((n, t, d)).astype(dt)
        q = rng.standard_normal((t, d) if per_token else (d,)).astype(dt)
        g = (1 + 0.3 * rng.standard_normal(d)).astype(dt) if gain else None
        h = opts.get("num_heads", 1)
        softmax = opts.get("activation", "softmax") == "softmax"
        c = rng.standard_normal((t, d)).astype(dt)
        cl = rng.standard_normal((t, h) if h > 1 else (t,)).astype(dt) if softmax else None
        xspec, qspec = P(None, None, "x"), (P(None, "x") if per_token else P("x"))

        def body(xs, q, g):
            return depth_attention_tp(xs, q, g, axis_name="x", return_lse=softmax, **opts)

        sharded = jax.shard_map(body, mesh=mesh, in_specs=(xspec, qspec, None if g is None else P("x")),
                                out_specs=(P(None, "x"), P()) if softmax else P(None, "x"))

        def loss(fn, xs, q, g):
            res = fn(xs, q, g)
            out, lse = res if softmax else (res, None)
            total = jnp.sum(out.astype(jnp.float64) * c)
            return total if lse is None else total + jnp.sum(lse * cl)

        def single(xs, q, g):
            return attnres_jax.depth_attention(xs, q, g, return_lse=softmax, **opts)

        argnums = (0, 1, 2) if gain else (0, 1)
        grad_s = jax.jit(jax.grad(lambda *a: loss(sharded, *a), argnums=argnums))
        grad_1 = jax.jit(jax.grad(lambda *a: loss(single, *a), argnums=argnums))
        got_fwd = jax.jit(sharded)(xs, q, g)
        one_fwd = single(xs, q, g)
        got, one = grad_s(xs, q, g), grad_1(xs, q, g)
        x64, q64, g64 = (None if a is None else np.asarray(a, np.float64) for a in (xs, q, g))
        want_fwd = ref.depth_attention(x64, q64, g64, return_lse=softmax, **opts)
        vjp = ref.depth_attention_vjp(x64, q64, g64, np.asarray(c, np.float64),
                                      None if cl is None else np.asarray(cl, np.float64), **opts)
        want = [vjp["sources"], vjp["query"]] + ([vjp["norm_weight"]] if gain else [])
        fwd_pairs = list(zip(got_fwd, want_fwd)) if softmax else [(got_fwd, want_fwd)]
        one_pairs = list(zip(got_fwd, one_fwd)) if softmax else [(got_fwd, one_fwd)]
        found = collectives(jax.make_jaxpr(grad_s)(xs, q, g).jaxpr, [])
        results["tp_" + name] = dict(
            dtype=dt, values=len(fwd_pairs),
            errors=[err(a, b) for a, b in fwd_pairs] + [err(a, b) for a, b in zip(got, want)],
            single_errors=[err(a, b) for a, b in one_pairs] + [err(a, b) for a, b in zip(got, one)],
            out_dtype=str(got_fwd[0].dtype if softmax else got_fwd.dtype),
            collectives=found, per_stat=n * t * h,
            stats=2 if opts.get("key_norm", True) else 1)

    # -- hidden-dimension sharding with the fused output norm (C17: over all D) ------------------
    ON_CASES = [  # name, dtype, N, T, D, options, out_norm_eps
        ("f64_heads", "float64", 3, 5, 16, dict(num_heads=2), None),
        ("f32_eps", "float32", 4, 6, 32, dict(eps=1e-5), 1e-3),
    ]
    for name, dt, n, t, d, opts, on_eps in ON_CASES:
        rng = np.random.default_rng(100 + len(name))
        xs = rng.standard_normal((n, t, d)).astype(dt)
        q = rng.standard_normal(d).astype(dt)
        g = (1 + 0.3 * rng.standard_normal(d)).astype(dt)
        wn = (1 + 0.3 * rng.standard_normal(d)).astype(dt)
        h = opts.get("num_heads", 1)
        c, cn = rng.standard_normal((t, d)).astype(dt), rng.standard_normal((t, d)).astype(dt)
        cl = rng.standard_normal((t, h) if h > 1 else (t,)).astype(dt)

        def body(xs, q, g, wn):
            return depth_attention_tp(xs, q, g, axis_name="x", return_lse=True, out_norm_weight=wn,
                                      out_norm_eps=on_eps, **opts)

        sharded = jax.shard_map(body, mesh=mesh, in_specs=(P(None, None, "x"), P("x"), P("x"), P("x")),
                                out_specs=(P(None, "x"), P(None, "x"), P()))

        def single(xs, q, g, wn):
            return attnres_jax.depth_attention(xs, q, g, return_lse=True, out_norm_weight=wn,
                                               out_norm_eps=on_eps, **opts)

        def loss(fn, *a):
            out, normed, lse = fn(*a)
            return (jnp.sum(out.astype(jnp.float64) * c) + jnp.sum(normed.astype(jnp.float64) * cn)
                    + jnp.sum(lse * cl))

        grad_s = jax.jit(jax.grad(lambda *a: loss(sharded, *a), argnums=(0, 1, 2, 3)))
        grad_1 = jax.jit(jax.grad(lambda *a: loss(single, *a), argnums=(0, 1, 2, 3)))
        got_fwd, one_fwd = jax.jit(sharded)(xs, q, g, wn), single(xs, q, g, wn)
        got, one = grad_s(xs, q, g, wn), grad_1(xs, q, g, wn)
        x64, q64, g64, w64 = (np.asarray(a, np.float64) for a in (xs, q, g, wn))
        want_fwd = ref.depth_attention(x64, q64, g64, return_lse=True, out_norm_weight=w64,
                                       out_norm_eps=on_eps, **opts)
        vjp = ref.depth_attention_vjp(x64, q64, g64, np.asarray(c, np.float64), np.asarray(cl, np.float64),
                                      out_norm_weight=w64, out_norm_eps=on_eps,
                                      d_out_normed=np.asarray(cn, np.float64), **opts)
        want = [vjp["sources"], vjp["query"], vjp["norm_weight"], vjp["out_norm_weight"]]
        found = collectives(jax.make_jaxpr(grad_s)(xs, q, g, wn).jaxpr, [])
        results["tp_out_norm_" + name] = dict(
            dtype=dt, values=3,
            errors=[err(a, b) for a, b in zip(got_fwd, want_fwd)] + [err(a, b) for a, b in zip(got, want)],
            single_errors=[err(a, b) for a, b in zip(got_fwd, one_fwd)] + [err(a, b) for a, b in zip(got, one)],
            out_dtype=str(got_fwd[1].dtype), collectives=found, per_stat=n * t * h, tokens=t)

    # -- sequence-sharded prefill --------------------------------------------------------------
    B, T, D, L, S = 2, 16, 8, 5, 2
    config = ResidualConfig(kind="block", block_size=S)
    for dt in ("float64", "float32"):
        rng = np.random.default_rng(3)
        emb = rng.standard_normal((B, T, D)).astype(dt)
        w = (rng.standard_normal((L, D, D)) * D ** -0.5).astype(dt)
        qs = (0.5 * rng.standard_normal((L + 1, D))).astype(dt)
        gs = (1 + 0.3 * rng.standard_normal((L + 1, D))).astype(dt)
        cot = rng.standard_normal((B, T, D)).astype(dt)

        def body(emb, w, qs, gs):
            # Column-parallel probe f_l(h) = tanh(rmsnorm(h) @ W_l): this device's output
            # columns, zeros elsewhere, so the psum_scatter sums the full f_l(h).
            dev = jax.lax.axis_index("x")
            cols = D // 8

            def sublayer(layer):
                def f(h):
                    wl = jax.lax.dynamic_slice_in_dim(w[layer], dev * cols, cols, axis=1)
                    y = jnp.tanh(attnres_jax.rmsnorm(h, config.eps) @ wl)
                    mask = jax.nn.one_hot(dev, 8, dtype=y.dtype)
                    return (y[..., None, :] * mask[:, None]).reshape(y.shape[:-1] + (D,))
                return f

            out, blocks = sequence_sharded_prefill(emb, [sublayer(l) for l in range(L)], qs, gs,
                                                   block_size=S, axis_name="x", seq_dim=1)
            return out

        sharded = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P(), P(), P()),
                                out_specs=P(None, "x"))

        def loss_s(emb, w, qs, gs):
            out = sharded(emb, w, qs, gs)
            return jnp.sum(out * cot), out

        def loss_1(emb, w, qs, gs):
            out = attnres_jax.probe_forward(config, {"queries": qs, "norm_weights": gs}, emb, w)
            return jnp.sum(out * cot), out

        (_, out), got = jax.jit(jax.value_and_grad(loss_s, (0, 1, 2, 3), has_aux=True))(emb, w, qs, gs)
        (_, one_out), one = jax.jit(jax.value_and_grad(loss_1, (0, 1, 2, 3), has_aux=True))(emb, w, qs, gs)
        params = {"queries": np.asarray(qs, np.float64), "norm_weights": np.asarray(gs, np.float64)}
        e64, w64 = np.asarray(emb, np.float64), np.asarray(w, np.float64)
        want_out = ref_model.probe_forward(config, params, e64, w64, schedule="two_phase")
        vjp = ref_model.probe_vjp(config, params, e64, w64, np.asarray(cot, np.float64))
        want = [vjp["embedding"], vjp["sublayer_weights"], vjp["queries"], vjp["norm_weights"]]
        found = collectives(jax.make_jaxpr(sharded)(emb, w, qs, gs).jaxpr, [])
        results["seq_" + dt] = dict(
            dtype=dt, values=1, errors=[err(out, want_out)] + [err(a, b) for a, b in zip(got, want)],
            single_errors=[err(out, one_out)] + [err(a, b) for a, b in zip(got, one)],
            out_dtype=str(out.dtype), collectives=found, tokens=B * T, dim=D, layers=L)
    print("RESULTS " + json.dumps(results))
''')


# Every test here reads the one subprocess run of the module fixture: collected first (`heavy`),
# so that the workers start on it.
pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def results():
    env = host_devices_env(8)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert line, proc.stdout[-2000:]
    return json.loads(line[0][len("RESULTS "):])


def _assert_within_table(r):
    """Outputs (the first r["values"] errors) and gradients (the rest), against the reference and
    against the single-device ops, within the suite's table as these tests apply it (`rtol_for`)."""
    rtols = [rtol_for(r["dtype"], grad=i >= r["values"]) for i in range(len(r["errors"]))]
    for key in ("errors", "single_errors"):
        assert len(r[key]) == len(rtols) and all(e <= t for e, t in zip(r[key], rtols)), (key, r[key], rtols)


TP_NAMES = ["f64_heads_cross_devices", "f64_sigmoid_token_query", "f64_no_key_norm_heads", "f32_softmax"]


@pytest.mark.parametrize("name", TP_NAMES)
def test_hidden_dim_sharding_equals_reference_and_single_device(results, name):
    r = results["tp_" + name]
    assert r["out_dtype"] == ("float64" if name.startswith("f64") else "float32")
    assert len(r["errors"]) >= 3
    _assert_within_table(r)


@pytest.mark.parametrize("name", TP_NAMES)
def test_hidden_dim_sharding_reduces_scalars_per_token_and_source(results, name):
    r = results["tp_" + name]
    # Exactly two collectives in forward + backward: the stats psum [stats, N, T, H] and the
    # backward psum [N, T, H] of the cotangent of the weights; nothing of size D.
    assert r["collectives"] == [["psum_invariant", [r["stats"] * r["per_stat"]]],
                                ["psum_invariant", [r["per_stat"]]]], r["collectives"]


@pytest.mark.parametrize("name", ["f64_heads", "f32_eps"])
def test_hidden_dim_sharding_fuses_the_output_norm(results, name):
    """C17 on hidden shards: out, out_normed and lse, and the gradients of the sources, query, gain
    and out_norm_weight (random cotangents on all three outputs) equal the float64 reference and
    the single-device op; the norm over all D costs one psum of T scalars (its sums of squares)
    in the forward and one in the backward, on top of the op's own two."""
    r = results["tp_out_norm_" + name]
    assert r["out_dtype"] == name.split("_")[0].replace("f", "float")
    assert len(r["errors"]) == 3 + 4
    _assert_within_table(r)
    # Forward: the stats [2, N, T, H] and the out norm's sums of squares [T]; backward: their
    # cotangents' reductions, [T] and [N, T, H].  Nothing of size D.
    sizes = sorted(c[1][0] for c in r["collectives"])
    assert all(c[0] == "psum_invariant" for c in r["collectives"]), r["collectives"]
    assert sizes == sorted([2 * r["per_stat"], r["tokens"], r["tokens"], r["per_stat"]]), r["collectives"]


@pytest.mark.parametrize("dt", ["float64", "float32"])
def test_sequence_sharded_prefill_equals_reference_and_single_device(results, dt):
    r = results["seq_" + dt]
    assert r["out_dtype"] == dt and len(r["errors"]) == 5
    _assert_within_table(r)


def test_sequence_sharded_prefill_communicates_only_the_tp_all_reduce_halves(results):
    r = results["seq_float64"]
    names = [c[0] for c in r["collectives"]]
    # Forward: per sublayer one all-gather of h and one reduce-scatter of the sublayer partial.
    assert names.count("all_gather") == r["layers"] and names.count("reduce_scatter") == r["layers"]
    assert len(names) == 2 * r["layers"], names
    per_device_tokens = r["tokens"] // 8
    assert all(c[1] == [per_device_tokens * r["dim"]] for c in r["collectives"] if c[0] == "all_gather")
    assert all(c[1] == [r["tokens"] * r["dim"]] for c in r["collectives"] if c[0] == "reduce_scatter")
