"""DTensor sharding strategies of the attnres custom ops (`dispatch.py`; docs/distributed.md,
"DTensor").  `dispatch._define` registers them for each implementation's ops when it defines
them (at the implementation's import), where `torch.distributed` is available.

Every op reduces over the hidden dim D only, token by token (C1-C12, C17), so sources sharded
over a token dim `d` (any dim but the last) run locally with no communication: the sources, a
per-token query, `out`, `lse` and the cotangents Shard(d); a `[D]` query, the gains and
`out_norm_weight` Replicate (their gradients Partial); outputs behind a leading dim Shard(d + 1);
all Replicate in, all Replicate out.  D-sharded inputs have no local strategy: DTensor
redistributes them.  The placements and the D-sharded routes: docs/distributed.md, "DTensor".

`torch.distributed.tensor.experimental.register_sharding` is not used: it counts a `Tensor[]`
return as one output (the backward ops return N + 2 gradients) and keeps the non-int arguments
out of the cache key (`with_weights` changes an output's shape).  The strategies go to DTensor's
propagator the way that function does it, with those two fixed.  Autograd hands the backward
ops a plain zero tensor for the cotangent of an unused output (lse, usually); a torch_dispatch
rule of DTensor on those ops makes it a replicated DTensor.
"""

from __future__ import annotations

import warnings

import torch

#: The op kinds with strategies here, in `dispatch.py`'s order; implementation `impl`'s op of
#: kind `k` is `attnres::<impl>_<k>`.
OPS = ("depth_attention", "depth_attention_weights", "depth_attention_backward",
       "depth_attention_multi", "depth_attention_out_norm", "depth_attention_out_norm_backward")

#: Qualified op name ("attnres::cpu_c_depth_attention") -> its kind, for every registered op.
_KINDS: dict = {}


def _placements(op: str, args: dict, d):
    """(outputs, inputs) placements of one strategy for token dim `d` of the sources (None: all
    replicated); inputs list the tensor arguments in the op's order, the sources flattened."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    rep = Replicate()
    tok = rep if d is None else Shard(d)  # token-sharded like the sources
    lead = rep if d is None else Shard(d + 1)  # behind a leading N or S dim
    red = rep if d is None else Partial()  # a sum over the tokens ([D] gradients)
    n = len(args["sources"])
    gains = [rep] * sum(args[k] is not None for k in ("norm_weight", "norm_weights") if k in args)
    if op == "depth_attention_multi":
        return [lead, lead], [tok] * n + [rep] + gains
    per_token = args["query"].ndim > 1  # C4: [D] or the sources' shape
    query = tok if per_token else rep
    inputs = [tok] * n + [query] + gains
    if op == "depth_attention":
        return [tok, tok], inputs
    if op == "depth_attention_weights":
        return [tok, tok, lead], inputs
    if op == "depth_attention_out_norm":
        return [tok, tok, tok, lead if args["with_weights"] else rep], inputs + [rep]
    d_query = tok if per_token else red
    optional = (args["out"] is not None) + (args["d_lse"] is not None)  # out: None with save
    if op == "depth_attention_backward":  # + out?, lse, d_out, d_lse?
        cot = 2 + optional
        return [tok] * n + [d_query, red], inputs + [tok] * cot
    # depth_attention_out_norm_backward: + out_norm_weight, out?, lse, d_out, d_out_normed, d_lse?
    cot = 3 + optional
    return [tok] * n + [d_query, red, red], inputs + [rep] + [tok] * cot


def _tensors(entry) -> list:
    """The sources argument as a list (DTensor's propagator hands a `TupleStrategy`)."""
    return list(getattr(entry, "children", entry))


def _strategy(op_schema):
    """DTensor's strategy function of every attnres op: the placements above for each token dim
    and for all-replicated, expanded over the mesh dims."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    op = _KINDS[op_schema.op._schema.name]
    names = [a.name for a in op_schema.op._schema.arguments]
    args = dict(zip(names, op_schema.args_schema))
    args.update(op_schema.kwargs_schema)
    args["sources"] = _tensors(args["sources"])
    ndim = args["sources"][0].ndim
    strategies, num_out = [], None
    for d in [None, *range(ndim - 1)]:
        outputs, inputs = _placements(op, args, d)
        strategies.append(outputs + inputs)
        num_out = len(outputs)
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, strategies,
                                           input_index=num_out)


#: The cotangent arguments of the backward ops (optional ones may be None).
_COTANGENTS = {"depth_attention_backward": ("d_out", "d_lse"),
               "depth_attention_out_norm_backward": ("d_out", "d_out_normed", "d_lse")}


def _replicate_plain_cotangents(cls, func, types, args, kwargs):
    """torch_dispatch rule of DTensor on the backward ops: a plain tensor with the global shape
    in a cotangent slot (autograd materializes the cotangent of an output nobody used, such as
    lse, as plain zeros) becomes a replicated DTensor on out's mesh; then DTensor's own
    dispatch runs the strategies above (NotImplemented falls through to it).  The first source
    stands for out (same shape and placement; out is None where the forward did not save it)."""
    from torch.distributed.tensor import DTensor, Replicate

    schema = func._schema
    names = [a.name for a in schema.arguments]
    values = dict(zip(names, args))
    values.update(kwargs)
    out = values["sources"][0]
    if not isinstance(out, DTensor):
        return NotImplemented
    changed = False
    for name in _COTANGENTS[_KINDS[schema.name]]:
        t = values.get(name)
        if (isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
                and tuple(t.shape) == tuple(out.shape[: t.dim()]) and t.dim() <= out.dim()):
            mesh = out.device_mesh
            values[name] = DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
            changed = True
    if not changed:
        return NotImplemented
    return func(*[values[n] for n in names])


def supported() -> bool:
    """Whether this torch has torch.distributed and the DTensor internals used here."""
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.tensor import DTensor  # noqa: F401
        from torch.distributed.tensor._op_schema import RuntimeSchemaInfo  # noqa: F401
        from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy  # noqa: F401
    except ImportError:  # private modules: a later torch may move them
        return False
    return True


def register(ops: dict) -> bool:
    """Register the strategies of the ops `{name: kind}` (names in namespace `attnres`, kinds
    among `OPS`) with DTensor, each once.  False, with a warning, where this torch lacks the
    DTensor internals used here; False where torch.distributed is absent."""
    if not torch.distributed.is_available():
        return False
    if not REGISTERED:
        warnings.warn("attnres_torch: no DTensor sharding strategies registered (this torch lacks "
                      "the DTensor internals used by attnres_torch.dtensor)", stacklevel=2)
        return False
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    propagator = DTensor._op_dispatcher.sharding_propagator
    for name, kind in ops.items():
        if kind not in OPS:
            raise ValueError(f"ops: kind {kind!r} of {name!r} is not one of {OPS}")
        qualified = f"attnres::{name}"
        if qualified in _KINDS:
            continue
        _KINDS[qualified] = kind
        op = getattr(torch.ops.attnres, name).default
        arguments = op._schema.arguments
        # Every non-tensor argument from the first on (eps, ..., with_weights) keys the cache.
        static = next(i for i, a in enumerate(arguments) if a.name == "eps")
        propagator.register_op_strategy(op, _strategy, RuntimeSchemaInfo(static, needs_pytree=True))
        if kind in _COTANGENTS:
            torch.library.register_torch_dispatch(op, DTensor, _replicate_plain_cotangents)
    return True


#: Whether strategies are registered for the ops (this torch has what `register` uses).
REGISTERED = supported()
