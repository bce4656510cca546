"""Flax NNX modules over the pure functions (needs the `flax` extra).

* `DepthAttention`: one depth-attention layer with its own pseudo-query and key-norm gain.
* `DepthRouter`: every `ResidualConfig` scheme around the user's sublayers; its parameters are
  named and shaped exactly as `ResidualConfig.param_shapes(L, D)` (so reference/probe params load
  1:1 with `load_params`) and initialized per the spec (M8, `ResidualConfig.init_params`).
* `Transformer`: a small causal decoder (attention and MLP sublayers, M1) built on the router,
  layer-scanned where the scheme allows (`scan_layers=None`, the default) or unrolled
  (`scan_layers=False`), with partitioning metadata on its parameters.

Partitioning: every weight matrix carries `nnx.with_partitioning` metadata over one tensor-
parallel axis, the `Transformer`'s `tensor_axis` (default `TENSOR_AXIS`, "model"; Megatron
layout: qkv / MLP-up column-parallel, attention-out / MLP-down row-parallel, vocab-parallel
embedding and head); the router's parameters, the norms' gains and the biases of row-parallel
layers are replicated.  The name is a Flax logical axis name: the mesh axis it lands on is the
name itself, or what `nnx.logical_axis_rules` maps it to where such rules are set (so
`tensor_axis="tp"` and `nnx.logical_axis_rules([("model", "tp")])` both fit a `("dp", "tp")`
mesh; `tensor_axis=None` replicates every parameter: data parallel only).
`nnx.get_named_sharding(nnx.state(model), mesh)` gives the shardings of a mesh with that axis
(and any data axes: the batch is the caller's).  Built under a mesh (`jax.set_mesh`, flax then
places each parameter as it is created) the model checks that the axis is one of the mesh's and
otherwise refuses, naming both fixes; `model.shardings(mesh)` makes the same check for a model
built outside the mesh.

Explicit mesh axes (`jax.make_mesh`'s default): the `Transformer`'s forward runs with the
explicit axes made Auto (`jax.sharding.auto_axes`, as the ops do: XLA places the
intermediates) and returns logits typed as the tokens (`[B, T]`'s spec, vocab unsharded); the
gradients come back typed as the parameters.
"""

from __future__ import annotations

import contextlib
from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
from attnres_core.config import ResidualConfig
from attnres_core.schedule import ScheduleObserver
from flax import nnx
from flax.core import meta as flax_meta
from flax.core import spmd as flax_spmd
from flax.nnx.nn import linear as flax_linear

from . import _mesh
from ._math import HIGHEST
from .ops import depth_attention, dtype_name
from .stack import Sublayer, resolve_scan_layers, scan_apply, stack_apply

#: The default tensor-parallel axis of the `Transformer`'s partitioning metadata (a logical axis
#: name: a mesh axis of that name, or what `nnx.logical_axis_rules` maps it to).
TENSOR_AXIS = "model"


class DepthAttention(nnx.Module):
    """One depth-attention layer: pseudo-query `query [D]` (zero init: uniform weights, M8) and
    key-norm gain `norm_weight [D]` (ones).  `__call__(sources)` takes N x `[..., D]` or
    `[N, ..., D]` and returns `[..., D]` (and lse / weights when asked).

    fuse_out_norm=True (C17, spec 2.6): the layer also owns the next sublayer's pre-norm gain
    `out_norm [D]` (ones; eps `out_norm_eps`, None = eps) and returns `(out, out_normed, lse?,
    weights?)`, out_normed = rmsnorm(out) * out_norm from the same pass."""

    def __init__(self, dim: int, *, eps: float = 1e-6, scale: float = 1.0, num_heads: int = 1,
                 activation: str = "softmax", key_norm: bool = True, fuse_out_norm: bool = False,
                 out_norm_eps: Optional[float] = None, dtype=jnp.float32):
        if out_norm_eps is not None and not fuse_out_norm:
            raise ValueError("out_norm_eps: given while fuse_out_norm is False")
        self.query = nnx.Param(jnp.zeros((dim,), dtype))
        self.norm_weight = nnx.Param(jnp.ones((dim,), dtype))
        self.out_norm = nnx.Param(jnp.ones((dim,), dtype)) if fuse_out_norm else None
        self.num_heads, self.activation, self.key_norm = num_heads, activation, key_norm
        self.eps, self.scale, self.out_norm_eps = eps, scale, out_norm_eps

    def __call__(self, sources, *, return_lse: bool = False, return_weights: bool = False):
        return depth_attention(sources, self.query[...], self.norm_weight[...], eps=self.eps,
                               scale=self.scale, num_heads=self.num_heads, activation=self.activation,
                               key_norm=self.key_norm, return_lse=return_lse,
                               return_weights=return_weights,
                               out_norm_weight=None if self.out_norm is None else self.out_norm[...],
                               out_norm_eps=self.out_norm_eps)


class DepthRouter(nnx.Module):
    """The residual scheme `config` over L = num_layers sublayers of width D = dim.

    Parameters: one `nnx.Param` per name of `config.param_shapes(L, D)` (e.g. `queries [L+1, D]`,
    `norm_weights [L+1, D]`), initialized with `config.init_params`.
    `__call__(embedding [..., D], sublayers, schedule="direct") -> [..., D]` (before any final norm).
    """

    def __init__(self, config: ResidualConfig, num_layers: int, dim: int, *, dtype=jnp.float32):
        self.config, self.num_layers, self.dim = config, num_layers, dim
        self.names = tuple(config.param_shapes(num_layers, dim))
        for name, value in config.init_params(num_layers, dim).items():
            setattr(self, name, nnx.Param(jnp.asarray(value, dtype)))

    def params(self) -> dict:
        """name -> array, shaped as `config.param_shapes(L, D)`."""
        return {name: getattr(self, name)[...] for name in self.names}

    def load_params(self, params: Mapping) -> None:
        """Set every parameter from a mapping name -> array (names and shapes must match)."""
        params = {k: jnp.asarray(v) for k, v in params.items()} if isinstance(params, Mapping) else params
        self.config.check_params(params, self.num_layers, self.dim, dtype_name)
        for name in self.names:
            var = getattr(self, name)
            var[...] = params[name].astype(var[...].dtype)

    def __call__(self, embedding, sublayers: Sequence[Sublayer], *, schedule: str = "direct",
                 mix=None, scale=None, observer: Optional[ScheduleObserver] = None,
                 remat: Optional[str] = None):
        """mix, scale: the M10 per-call inputs of `stack_apply` (progressive introduction,
        temperature; arrays trace under `jit`); observer, remat: as in `stack_apply`."""
        return stack_apply(self.config, self.params(), embedding, sublayers, schedule=schedule,
                           mix=mix, scale=scale, observer=observer, remat=remat)

    def scan(self, embedding, sublayers: Sequence, layer_params, *, mix=None, scale=None,
             remat: Optional[str] = None, unroll: int = 1, stages: Optional[int] = None,
             backward: Optional[str] = None, record=None):
        """The layer-scanned form (`scan_apply`): sublayers `f_j(p, h)` over the slices p of
        `layer_params` (leaves `[n, ...]`, L = n * len(sublayers)); record: `scan_apply`'s
        (statistics carried out of the scan; then returns `(out, recorded)`)."""
        return scan_apply(self.config, self.params(), embedding, sublayers, layer_params, mix=mix,
                          scale=scale, remat=remat, unroll=unroll, stages=stages, backward=backward,
                          record=record)


def _identity(h):
    """The pre-norm of a sublayer whose router hands it the normed input (M15)."""
    return h


def _kernel(spec):
    """nnx.Linear's default kernel init with partitioning metadata `spec` (over the tensor axis)."""
    return nnx.with_partitioning(flax_linear.default_kernel_init, spec)


def _specs(axis: Optional[str]):
    """(column-parallel, row-parallel) kernel specs over the tensor axis `axis`."""
    return (None, axis), (axis, None)


def _mesh_axis(axis: Optional[str]):
    """The mesh axis that the logical axis name `axis` lands on under the active
    `nnx.logical_axis_rules` (itself where no rule names it)."""
    if axis is None:
        return None
    return dict(flax_spmd.get_logical_axis_rules() or ()).get(axis, axis)


def _check_axis(axis: Optional[str], mesh, where: str) -> None:
    """Refuse a tensor axis that lands on no axis of `mesh`, naming the fixes."""
    target = _mesh_axis(axis)
    if mesh is None or target is None:
        return
    targets = target if isinstance(target, (tuple, list)) else (target,)
    missing = [t for t in targets if t is not None and t not in mesh.axis_names]
    if missing:
        via = "" if target == axis else f" (mapped to {target!r} by nnx.logical_axis_rules)"
        raise ValueError(
            f"{where}: the Transformer's tensor-parallel axis {axis!r}{via} is not an axis of the "
            f"mesh {tuple(mesh.axis_names)}; build it with tensor_axis=<one of "
            f"{tuple(mesh.axis_names)}> (tensor_axis=None: every parameter replicated, data "
            f"parallel only), or map the name with nnx.logical_axis_rules([({axis!r}, "
            f"<mesh axis>)]) around construction and nnx.get_named_sharding")


def _linear(d_in: int, d_out: int, spec, rngs: nnx.Rngs, dtype, *, use_bias: bool = False) -> nnx.Linear:
    bias = {"bias_init": nnx.with_partitioning(flax_linear.default_bias_init, (spec[1],))} if use_bias else {}
    return nnx.Linear(d_in, d_out, use_bias=use_bias, precision=HIGHEST, kernel_init=_kernel(spec),
                      param_dtype=dtype, rngs=rngs, **bias)


class _Attention(nnx.Module):
    """Causal multi-head self-attention sublayer with its own pre-RMSNorm: `[B, T, D] -> [B, T, D]`."""

    def __init__(self, dim: int, num_heads: int, eps: float, rngs: nnx.Rngs, prenorm: bool = True,
                 dtype=jnp.float32, axis: Optional[str] = TENSOR_AXIS):
        column, row = _specs(axis)
        self.norm = nnx.RMSNorm(dim, epsilon=eps, param_dtype=dtype, rngs=rngs) if prenorm else _identity
        self.qkv = _linear(dim, 3 * dim, column, rngs, dtype)
        self.out = _linear(dim, dim, row, rngs, dtype)
        self.num_heads = num_heads

    def __call__(self, h):
        b, t, d = h.shape
        q, k, v = jnp.split(self.qkv(self.norm(h)).reshape(b, t, 3, self.num_heads, -1), 3, axis=2)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]  # [B, T, H, Dh]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) / jnp.sqrt(q.shape[-1])
        mask = jnp.tril(jnp.ones((t, t), bool))
        probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=HIGHEST).reshape(b, t, d))


class _MLP(nnx.Module):
    """GELU MLP sublayer with its own pre-RMSNorm: `[..., D] -> [..., D]`."""

    def __init__(self, dim: int, hidden: int, eps: float, rngs: nnx.Rngs, prenorm: bool = True,
                 dtype=jnp.float32, axis: Optional[str] = TENSOR_AXIS):
        column, row = _specs(axis)
        self.norm = nnx.RMSNorm(dim, epsilon=eps, param_dtype=dtype, rngs=rngs) if prenorm else _identity
        self.up = _linear(dim, hidden, column, rngs, dtype, use_bias=True)
        self.down = _linear(hidden, dim, row, rngs, dtype, use_bias=True)

    def __call__(self, h):
        return self.down(jax.nn.gelu(self.up(self.norm(h))))


class _Block(nnx.Module):
    """One transformer block's two sublayers (attention, MLP), the period of a scanned stack."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int, eps: float, rngs: nnx.Rngs,
                 prenorm: bool, dtype, axis: Optional[str] = TENSOR_AXIS):
        self.attention = _Attention(dim, num_heads, eps, rngs, prenorm=prenorm, dtype=dtype, axis=axis)
        self.mlp = _MLP(dim, mlp_ratio * dim, eps, rngs, prenorm=prenorm, dtype=dtype, axis=axis)


def _stacked(modules: list) -> nnx.Module:
    """One module of the same structure whose every variable stacks the modules' `[n, ...]`;
    partitioning metadata gains a leading None (the layer axis is not sharded)."""
    graphdef, first = nnx.split(modules[0])
    states = [first] + [nnx.split(m)[1] for m in modules[1:]]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    module = nnx.merge(graphdef, stacked)
    for _, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Variable) and var.get_metadata().get("out_sharding"):
            var.set_metadata(out_sharding=(None,) + tuple(var.get_metadata()["out_sharding"]))
    return module


def _partitioning_context():
    """Record partitioning metadata without placing values when no mesh is active (flax's
    eager sharding needs one); under a mesh, flax places the values as it creates them."""
    if flax_meta.get_global_mesh() is None:
        return nnx.use_eager_sharding(False)
    return contextlib.nullcontext()


class Transformer(nnx.Module):
    """A small causal decoder: tokens `[B, T]` -> logits `[B, T, vocab]`.

    num_blocks transformer blocks = L = 2 * num_blocks sublayers (attention, MLP; M1) combined by
    a `DepthRouter(config, L, dim)`, then a final RMSNorm and the LM head.  config "standard" is
    the PreNorm baseline.  With `config.fuse_out_norm` (M15) the router owns the pre-norm and
    final-norm gains (`out_norm_weights`, eps = config.eps, so `eps` must equal it) and hands each
    sublayer its normed input; the model's own norms are then not created.

    scan_layers: None (the default: True for the kinds `scan_apply` runs, `SCAN_KINDS` =
    standard, scalar, gated, full, block; False for the others), True or False.  True:
    `blocks`, one `_Block` whose variables are stacked `[num_blocks, ...]`, run by one
    `scan_apply` over the blocks (compile time flat in depth; a kind outside `SCAN_KINDS` is
    refused, naming scan_layers=False).  False: `sublayers`, a list of 2 * num_blocks modules,
    run unrolled by `stack_apply` (every kind; compile time grows with depth).  Both draw the
    same weights from the same rngs and give the same logits; their NNX states differ in layout
    (`blocks` `[num_blocks, ...]` against `sublayers[i]`), so a checkpoint restores into a model
    built with the same form.  The scanned form called with a `training.DepthMonitor`'s
    observer carries the statistics out of the scan (`scan_apply(record=)`, backward "scan"):
    the monitored step compiles flat in depth too.  With another observer or
    schedule="two_phase" it runs its stacked weights unrolled (`stack_apply` over the blocks'
    slices: the same values, the observer sees every read and sublayer), so that call compiles
    as the unrolled model does.
    remat: None, "recompute" or "offload" (`attnres_jax.stack.remat_policy`) for every call.
    scan_backward: None (`scan_apply`'s default), "fused", "replay" or "scan": the scanned
    form's backward (`scan_apply(backward=)`).
    param_dtype: the dtype of every parameter (the stream runs in the embedding's, M1a).
    tensor_axis: the tensor-parallel axis of the partitioning metadata (module docstring): a mesh
    axis name, or a logical name that `nnx.logical_axis_rules` maps to one; None replicates
    every parameter.  Built under a mesh without that axis: ValueError naming the fixes.

    Under Explicit mesh axes (`jax.make_mesh`'s default) the call runs with them made Auto and
    returns logits typed as `tokens` (vocab unsharded).
    """

    def __init__(self, config: ResidualConfig, *, vocab_size: int, dim: int, num_blocks: int,
                 num_heads: int, rngs: nnx.Rngs, eps: float = 1e-6, mlp_ratio: int = 4,
                 scan_layers: Optional[bool] = None, remat: Optional[str] = None, param_dtype=jnp.float32,
                 scan_backward: Optional[str] = None, tensor_axis: Optional[str] = TENSOR_AXIS):
        fused = config.fuse_out_norm  # M15
        scan_layers = resolve_scan_layers(config.kind, scan_layers)
        if fused and eps != config.eps:
            raise ValueError(f"eps: with fuse_out_norm the router's norms use config.eps = "
                             f"{config.eps}, so the model's eps must equal it; got eps={eps}")
        if tensor_axis is not None and not isinstance(tensor_axis, str):
            raise TypeError(f"tensor_axis: a mesh or logical axis name (str) or None; got {tensor_axis!r}")
        _check_axis(tensor_axis, flax_meta.get_global_mesh(), "Transformer(...) under the mesh")
        column, row = _specs(tensor_axis)
        with _partitioning_context():
            self.embed = nnx.Embed(vocab_size, dim, param_dtype=param_dtype, rngs=rngs,
                                   embedding_init=nnx.with_partitioning(flax_linear.default_embed_init, row))
            blocks = [_Block(dim, num_heads, mlp_ratio, eps, rngs, not fused, param_dtype, tensor_axis)
                      for _ in range(num_blocks)]
            if scan_layers:
                self.blocks = _stacked(blocks)
            else:
                self.sublayers = nnx.List([m for b in blocks for m in (b.attention, b.mlp)])
            self.router = DepthRouter(config, 2 * num_blocks, dim, dtype=param_dtype)
            self.final_norm = _identity if fused else nnx.RMSNorm(dim, epsilon=eps, param_dtype=param_dtype,
                                                                  rngs=rngs)
            self.head = _linear(dim, vocab_size, column, rngs, param_dtype)
        self.scan_layers, self.remat, self.scan_backward = scan_layers, remat, scan_backward
        self.tensor_axis = tensor_axis

    def shardings(self, mesh):
        """`nnx.get_named_sharding(nnx.state(self), mesh)` after checking that the tensor axis
        (under the active `nnx.logical_axis_rules`) is one of `mesh`'s axes: a model built
        outside the mesh gets the refusal that construction under the mesh gives, naming the
        fixes, instead of JAX's "Resource axis ... not found"."""
        _check_axis(self.tensor_axis, mesh, "Transformer.shardings(mesh)")
        return nnx.get_named_sharding(nnx.state(self), mesh)

    def __call__(self, tokens, *, schedule: str = "direct", mix=None, scale=None,
                 observer: Optional[ScheduleObserver] = None):
        """tokens `[B, T]` -> logits `[B, T, vocab]`; schedule, mix, scale, observer as in
        `stack_apply` (mix and scale may be traced arrays).  The scanned form (the default where
        the kind allows) with a `DepthMonitor`'s observer: statistics out of the scan; with
        another observer or schedule="two_phase": the stacked weights run unrolled (class
        docstring).  Under
        Explicit mesh axes: run with them made Auto, logits typed as `tokens` with the vocab
        axis unsharded."""
        graphdef, state = nnx.split(self)
        values = {"state": state, "tokens": tokens, "mix": mix, "scale": scale}
        if _mesh.explicit_mesh(*(x for x in jax.tree_util.tree_leaves(values) if hasattr(x, "dtype"))) is None:
            return self._logits(tokens, schedule, mix, scale, observer)

        def run(state, tokens, mix, scale):
            return nnx.merge(graphdef, state)._logits(tokens, schedule, mix, scale, observer)

        tokens_spec = _mesh.spec(tokens) if hasattr(tokens, "dtype") else (None,) * jnp.ndim(tokens)
        return _mesh.auto_arrays(run, values, _mesh.P(*tokens_spec, None))

    def _logits(self, tokens, schedule, mix, scale, observer):
        x = self.embed(tokens)
        if not self.scan_layers:
            h = self.router(x, list(self.sublayers), schedule=schedule, mix=mix, scale=scale,
                            observer=observer, remat=self.remat)
            return self.head(self.final_norm(h))
        graphdef, state = nnx.split(self.blocks)
        records = observer is not None and schedule == "direct" and hasattr(observer, "scanned")
        if (observer is not None and not records) or schedule != "direct":  # unrolled over the stacked weights
            blocks = [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
                      for i in range(self.router.num_layers // 2)]
            h = self.router(x, [m for b in blocks for m in (b.attention, b.mlp)], schedule=schedule,
                            mix=mix, scale=scale, observer=observer, remat=self.remat)
            return self.head(self.final_norm(h))
        sublayers = (lambda p, h: nnx.merge(graphdef, p).attention(h),
                     lambda p, h: nnx.merge(graphdef, p).mlp(h))
        if records:  # the monitor's statistics carried out of the scan (backward "scan")
            h, recorded = self.router.scan(x, sublayers, state, mix=mix, scale=scale, remat=self.remat,
                                           record=observer)
            observer.scanned(self.router.config, self.router.num_layers, len(sublayers), recorded)
            return self.head(self.final_norm(h))
        h = self.router.scan(x, sublayers, state, mix=mix, scale=scale, remat=self.remat,
                             backward=self.scan_backward)
        return self.head(self.final_norm(h))

