"""attnres_core: the framework-neutral spec core of AttnRes that every backend imports (numpy only).

  `config`      the serializable `ResidualConfig` (spec section 5, M1-M9) and `VARIANT_KINDS`.
  `validation`  the argument checks (same messages everywhere; spec "Errors").
  `numerics`    the compute-dtype rule (C10) and exact rounding to fp32/fp16/bf16.
  `schedule`    the residual schedule of every scheme, written once, over a backend's ops object
                (`ResidualOps`, `ResidualStream`, `FixedResidualStream`, `run_schedule`).
  `probe`       the spec's probe network (section 6), written once over an ops object.
  `training`    the training tools' framework-neutral part: M10 curves, collapse statistics and
                policy decisions, the FLA/K3 checkpoint key mappings.
  `dispatch`    the public backend contract's bookkeeping (`Choice`, the forcing behind
                `use_impl`, the record behind `last_choice` / `impl_counts`), standard library
                only; each backend's `dispatch` module builds on it.

It is the distribution `attnres-core`, which every backend, the float64 oracle (`attnres-numpy`:
`ops`, `tape`, `model`, `vectors`) and the conformance suite depend on; nothing here imports the
oracle.  Import the modules
by their path (`from attnres_core.config import ResidualConfig`); this package imports none of them.
"""

__all__ = ["config", "dispatch", "numerics", "probe", "schedule", "training", "validation"]
