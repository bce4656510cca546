"""Explicit mesh axes (`jax.sharding.AxisType.Explicit`, the default of `jax.make_mesh` since
jax 0.9): the package's functions take explicitly sharded arrays and return arrays whose types
follow their inputs'.

Under Explicit axes every operation must have one well-defined output sharding, and a
contraction over a sharded axis (the backward's sum over tokens of a query gradient), a reshape
of a sharded axis into heads, a select between differently typed operands or a `pallas_call`
have none.  The package's computations therefore run inside `jax.sharding.auto_axes`: on entry
the explicit axes become Auto ones (XLA's partitioner places the intermediates, as it does for a
mesh built with Auto axes), and the results get the explicit types this module derives from the
inputs': a result over tokens `[..., D]` is sharded as the call's token-sharded input is, a
per-token statistic `[..., H]` over the same token axes.  Outside a mesh, under Auto axes and
inside `shard_map` (Manual axes) `auto` calls the function unchanged.  A leaf module.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def _mesh_of(x):
    """The abstract mesh of x's type, or None (a NumPy array, an unsharded type)."""
    try:
        sharding = jax.typeof(x).sharding
    except (TypeError, AttributeError):
        return None
    mesh = getattr(sharding, "mesh", None)
    return None if mesh is None or mesh.empty else mesh


def explicit_mesh(*arrays):
    """The mesh whose Explicit axes type these arrays (the context mesh, `jax.set_mesh`, or else
    the first array's own), or None when no axis is Explicit."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = next((m for m in map(_mesh_of, arrays) if m is not None), None)
    if mesh is None or not any(t == AxisType.Explicit for t in mesh.axis_types):
        return None
    return mesh


def spec(x) -> tuple:
    """x's PartitionSpec as a tuple of one entry per axis (None: not sharded)."""
    entries = tuple(jax.typeof(x).sharding.spec)
    return entries + (None,) * (jax.typeof(x).ndim - len(entries))


def auto(fn: Callable, args: tuple, out_specs, mesh=None):
    """`fn(*args)`, run with the Explicit axes of `mesh` (`explicit_mesh(*leaves of args)` when
    None) made Auto, its results typed by `out_specs` (a pytree of PartitionSpecs
    matching fn's results, None for None results).  Without Explicit axes: `fn(*args)`."""
    if mesh is None:
        mesh = explicit_mesh(*jax.tree_util.tree_leaves(args))
    if mesh is None:
        return fn(*args)
    axes = tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit)
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), out_specs,
                                       is_leaf=lambda s: isinstance(s, P))
    return jax.sharding.auto_axes(fn, axes=axes, out_sharding=shardings)(*args)


def token_specs(x, stacked: bool = False) -> Tuple[tuple, Optional[str]]:
    """(the token axes' spec, the channel axis' entry) of a source `[..., D]` (`[N, ..., D]` when
    stacked)."""
    s = spec(x)[1:] if stacked else spec(x)
    return s[:-1], s[-1]


def auto_arrays(fn: Callable, values: dict, out_specs):
    """`fn(**values)` as `auto` runs it, with only the array leaves of `values` passed through
    (Python numbers and None stay static: a float `mix` keeps its meaning)."""
    leaves, tree = jax.tree_util.tree_flatten(values)
    is_array = [hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves]
    mesh = explicit_mesh(*(x for x, a in zip(leaves, is_array) if a))
    if mesh is None:
        return fn(**values)

    def inner(*arrays):
        it = iter(arrays)
        return fn(**jax.tree_util.tree_unflatten(tree, [next(it) if a else x for x, a in zip(leaves, is_array)]))

    return auto(inner, tuple(x for x, a in zip(leaves, is_array) if a), out_specs, mesh)
