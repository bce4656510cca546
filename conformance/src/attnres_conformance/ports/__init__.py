"""Adapters of specific implementations, each on a framework-only base of `adapters/`:
`attnres_torch`, `attnres_jax`, `attnres_mlx` (this project's backends, registry names "torch",
"jax", "mlx") and the public ports of other projects (the compliance table's rows).  Each module
imports its port only when chosen."""

from ..backend import OPS, OPTIONS, SCHEDULES, Capabilities


def contract_capabilities(contract: dict, **overrides) -> Capabilities:
    """Every op, option, named variant and schedule, with the dtypes, devices, fused_kernel and
    deterministic of a backend contract's `capabilities()` (attnres_core.dispatch) answer."""
    from attnres_core.config import VARIANT_KINDS

    fields = dict(dtypes=contract["dtypes"], devices=contract["devices"], ops=frozenset(OPS),
                  options=frozenset(OPTIONS), variants=frozenset(VARIANT_KINDS), schedules=frozenset(SCHEDULES),
                  fused_kernel=contract["fused_kernel"], deterministic=contract["deterministic"])
    return Capabilities(**dict(fields, **overrides))
