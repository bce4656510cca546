"""Data + tensor parallel training of the NNX `Transformer` on a 2 x 4 mesh of 8 host CPU devices
(a subprocess: the device count must be set before JAX initializes), with shardings taken from
the parameters' partitioning metadata only (`nnx.get_named_sharding`): one AdamW step equals the
single-device step, the weights stay sharded as their metadata says, for the unrolled and the
layer-scanned model."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from jax_helpers import host_devices_env

SCRIPT = textwrap.dedent(r'''
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from attnres_core.config import ResidualConfig
    from attnres_jax.modules import Transformer

    assert len(jax.devices()) == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    config = ResidualConfig.variant("block", block_size=2)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (4, 8)))

    def step(model, opt_state, tokens, tx):
        def loss(m):
            logits = m(tokens[:, :-1], scale=jnp.asarray(0.8))
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        graphdef, params = nnx.split(model)
        value, grads = jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    for scan in (False, True):
        model = Transformer(config, vocab_size=32, dim=16, num_blocks=2, num_heads=4, rngs=nnx.Rngs(0),
                            scan_layers=scan)
        router = {k: np.random.default_rng(1).standard_normal(v.shape).astype(np.float32)
                  for k, v in model.router.params().items()}
        model.router.load_params(router)
        graphdef, params = nnx.split(model)
        tx = optax.adamw(1e-2)
        want_loss, want_params, _ = jax.jit(lambda p, t: step(nnx.merge(graphdef, p), tx.init(p), t, tx))(params, tokens)

        shardings = nnx.get_named_sharding(params, mesh)  # from the metadata only
        sharded = jax.device_put(params, shardings)
        opt_state = tx.init(sharded)
        data = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
        run = jax.jit(lambda p, s, t: step(nnx.merge(graphdef, p), s, t, tx), out_shardings=(None, shardings, None))
        got_loss, got_params, _ = run(sharded, opt_state, data)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
        for (path, a), (_, b) in zip(nnx.to_flat_state(got_params), nnx.to_flat_state(want_params)):
            np.testing.assert_allclose(np.asarray(a[...]), np.asarray(b[...]), rtol=2e-4, atol=2e-5, err_msg=str(path))
        flat = dict(nnx.to_flat_state(got_params))
        lead = ("blocks", "attention") if scan else ("sublayers", 0)
        qkv = flat[lead + ("qkv", "kernel")][...]
        assert qkv.sharding.spec == P(*((None,) if scan else ()), None, "model"), qkv.sharding
        assert len(qkv.addressable_shards) == 8 and qkv.addressable_shards[0].data.shape[-1] == qkv.shape[-1] // 4
        assert flat[("router", "queries")][...].sharding.is_fully_replicated
        print("SCAN" if scan else "UNROLLED", float(got_loss))
    print("PARTITIONING-OK")
''')


@pytest.mark.heavy
def test_data_and_tensor_parallel_step_from_metadata():
    env = host_devices_env(8)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PARTITIONING-OK" in proc.stdout
