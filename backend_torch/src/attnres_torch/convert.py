"""Converting an existing PreNorm model, and per-layer ownership of the residual parameters.

A PreNorm block computes `x = x + f(norm(x))` once per sublayer (attention, MLP).  AttnRes keeps
every `f(norm(.))` exactly as it is and replaces the additions (spec M1: each of them is one
sublayer).  `wrap_prenorm` does that for a stack of blocks without touching their code::

    stack = wrap_prenorm(model.h, ResidualConfig(kind="block", block_size=4), sublayers="gpt2")
    h = stack(embedding)                     # replaces `for block in model.h: h = block(h)`
    h, hidden_states = stack(embedding, output_hidden_states=True)
    logits = model.lm_head(model.ln_f(h))

Per-layer ownership (`per_layer=True`, the default of `wrap_prenorm`): every sublayer owns its row
of the scheme's parameters as its own `nn.Parameter`s in a `DepthSite` (as flash-linear-attention's
and the Kimi model code's decoder layers own `attn_res_proj` / `attn_res_norm`): block i gets a
`block.attnres` ModuleList of one site per sublayer, the stack an `attnres_output` site.  So each
block's `state_dict` carries its own AttnRes parameters (per-layer checkpoints, sharded loading),
the PreNorm keys are unchanged (a PreNorm checkpoint loads with `strict=False`, missing only the
`attnres` keys), and `stack.layer(i, stream)` runs one block alone.

`PerLayerRouter` is the router over such sites: a `DepthRouter` whose parameters are presented to
the shared schedule (`attnres_core.schedule.ResidualStream` through `TorchOps`) as `RowStack`
views, so the schedule exists once; `stacked()` / `load_stacked()` convert to and from the
`DepthRouter` layout (`ResidualConfig.param_shapes`), which `attnres_torch.checkpoints` reads and
writes.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from attnres_core.config import ResidualConfig
from torch import nn

from .modules import DepthRouter

#: Row names: a stacked parameter of `ResidualConfig.param_shapes` -> one row's name in a site.
ROW_NAMES = {"queries": "query", "norm_weights": "norm_weight", "query_weights": "query_weight",
             "alphas": "alpha", "gate_weights": "gate_weight", "gate_biases": "gate_bias",
             "depth_weights": "depth_weight", "out_norm_weights": "out_norm_weight"}

#: Sublayer layouts of common PreNorm blocks: per sublayer, (norm attribute, function attribute).
LAYOUTS: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "gpt2": (("ln_1", "attn"), ("ln_2", "mlp")),                                  # HF GPT-2
    "llama": (("input_layernorm", "self_attn"), ("post_attention_layernorm", "mlp")),  # HF Llama, Kimi
    "fla": (("attn_norm", "attn"), ("mlp_norm", "mlp")),                           # flash-linear-attention
    "timm": (("norm1", "attn"), ("norm2", "mlp")),                                 # ViT-style blocks
}

SublayerSpec = Union[Tuple[str, str], Callable]


class RowStack:
    """Per-row tensors presented as one stacked `[R, ...]` array to `TorchOps.param`:
    `x[r]` is row r itself (no copy, so its gradient reaches that parameter), `x[a:b]` the rows
    stacked (the two-phase schedule's phase 1), `x[r, i]` element i of row r (static weights)."""

    def __init__(self, rows: Sequence[torch.Tensor]):
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.rows), *self.rows[0].shape))

    def __getitem__(self, index):
        if isinstance(index, tuple):
            return self.rows[index[0]][index[1:]]
        if isinstance(index, slice):
            return torch.stack(self.rows[index])
        return self.rows[index]


class SiteRows(RowStack):
    """The rows named `attr` of a list of sites, read from the sites at every access (not when
    the view is made): FSDP2 swaps a site's sharded parameter for the gathered one only while
    the owning layer runs, so a pass must see the parameter of that moment."""

    def __init__(self, sites: Sequence[nn.Module], attr: str):
        self.sites, self.attr = [s for s in sites if getattr(s, attr, None) is not None], attr

    @property
    def rows(self) -> List[torch.Tensor]:
        return [getattr(s, self.attr) for s in self.sites]

    def __len__(self) -> int:
        return len(self.sites)

    def __getitem__(self, index):
        # One row, read from its site now: each depth read takes its own row, and listing all
        # L + 1 sites for it was ~1 % of a batch-1 decode token at d = 1024.
        if type(index) is int:
            return getattr(self.sites[index], self.attr)
        if isinstance(index, tuple) and type(index[0]) is int:
            return getattr(self.sites[index[0]], self.attr)[index[1:]]
        return super().__getitem__(index)


class DepthSite(nn.Module):
    """Row r of each of a scheme's parameters as this module's own parameters: what one sublayer
    (or the output aggregation) owns.  Names (`ROW_NAMES`): `query` `[D]` and `norm_weight` `[D]`
    (attention kinds), `query_weight` `[D, D]` (query="input"), `alpha` `[]`, `gate_weight`
    `[D, D]`, `gate_bias` `[D]`, `depth_weight` `[L+1]`, `out_norm_weight` `[D]` (M15: the
    pre-norm gain of this sublayer's input, or of the output)."""

    def __init__(self, rows: Mapping[str, torch.Tensor]):
        super().__init__()
        for name, value in rows.items():
            self.register_parameter(ROW_NAMES[name], nn.Parameter(value))


def _check_dims(config, num_layers, dim) -> None:
    if not isinstance(config, ResidualConfig):
        raise TypeError(f"config: expected a ResidualConfig, got {type(config).__name__}")
    config.param_shapes(num_layers, dim)  # checks num_layers, dim, heads


def make_sites(config: ResidualConfig, num_layers: int, dim: int,
               dtype: torch.dtype = torch.float32) -> List[DepthSite]:
    """L + 1 sites holding `config.init_params(L, D)` row by row (site L: the output aggregation;
    it is empty for the kinds without an output row)."""
    _check_dims(config, num_layers, dim)
    init = {k: torch.tensor(v, dtype=dtype) for k, v in config.init_params(num_layers, dim).items()}
    return [DepthSite({k: v[r].clone() for k, v in init.items() if r < v.shape[0]})
            for r in range(num_layers + 1)]


class PerLayerRouter(DepthRouter):
    """A `DepthRouter` whose parameters live in L + 1 `DepthSite`s (one per sublayer and the
    output aggregation) instead of stacked `[L+1, D]` tensors; same schedule, same results.

    Args:
      config, num_layers, dim, schedule: as `DepthRouter`.
      dtype: the sites' parameter dtype when the router creates them (default float32).
      sites: L + 1 existing sites owned elsewhere (e.g. by the model's blocks, as `wrap_prenorm`
        places them); the router then only refers to them (they are not its submodules, so its
        own `state_dict` is empty and the owners' carry them).  None: the router creates and owns
        them as `self.sites`.
    """

    def __init__(self, config: ResidualConfig, num_layers: int, dim: int,
                 schedule: Optional[str] = None, *, dtype: torch.dtype = torch.float32,
                 sites: Optional[Sequence[DepthSite]] = None):
        nn.Module.__init__(self)
        _check_dims(config, num_layers, dim)
        if getattr(config, "query_sharing", "none") != "none":
            raise ValueError(f"config: per-layer ownership gives every sublayer its own query row, but "
                             f"query_sharing={config.query_sharing!r} shares rows between sublayers; "
                             "use DepthRouter (wrap_prenorm(..., per_layer=False))")
        if getattr(config, "key_rank", None) is not None:  # M13: one key_projection for the stack
            raise ValueError(f"config: per-layer ownership splits parameters into one row per "
                             f"sublayer, but key_rank={config.key_rank} adds one key_projection "
                             "[D, r] shared by every sublayer; use DepthRouter "
                             "(wrap_prenorm(..., per_layer=False))")
        if schedule is not None:
            config.check_schedule(schedule)
        self.config, self.num_layers, self.dim, self.schedule = config, num_layers, dim, schedule
        self._names = tuple(config.param_shapes(num_layers, dim))
        if sites is None:
            self.sites = nn.ModuleList(make_sites(config, num_layers, dim, dtype))
            self._external = None
        else:
            sites = list(sites)
            if len(sites) != num_layers + 1 or not all(isinstance(s, DepthSite) for s in sites):
                raise ValueError(f"sites: expected {num_layers + 1} DepthSite modules (one per "
                                 f"sublayer and the output), got {len(sites)}")
            self._external = sites
            self._check_sites()

    def site_list(self) -> List[DepthSite]:
        return list(self.sites) if self._external is None else self._external

    def _check_sites(self) -> None:
        shapes = self.config.param_shapes(self.num_layers, self.dim)
        for r, site in enumerate(self.site_list()):
            for name, shape in shapes.items():
                want = shape[1:] if r < shape[0] else None
                got = getattr(site, ROW_NAMES[name], None)
                if (want is None) != (got is None) or (got is not None and tuple(got.shape) != want):
                    raise ValueError(f"sites: site {r} {ROW_NAMES[name]} expected shape "
                                     f"{want}, got {None if got is None else tuple(got.shape)}")

    def row_parameter(self, name: str, row: int) -> nn.Parameter:
        """Row `row` of stacked parameter `name` ("queries", ...): the site's own parameter."""
        if name not in self._names:
            raise ValueError(f"name: expected one of {self._names}, got {name!r}")
        return getattr(self.site_list()[row], ROW_NAMES[name])

    def __getattr__(self, name: str):
        # DepthRouter.stream reads the stacked parameters by name; hand it the rows as a view.
        if name in ROW_NAMES and name in self.__dict__.get("_names", ()):
            return SiteRows(self.site_list(), ROW_NAMES[name])  # alphas, gates: L rows
        return super().__getattr__(name)

    def stacked(self) -> Dict[str, torch.Tensor]:
        """The `DepthRouter` layout: name -> `[R, ...]` tensor (a differentiable stack)."""
        shapes = self.config.param_shapes(self.num_layers, self.dim)
        return {name: torch.stack([self.row_parameter(name, r) for r in range(shapes[name][0])])
                for name in self._names}

    @torch.no_grad()
    def load_stacked(self, params: Mapping[str, torch.Tensor]) -> None:
        """Copy a `DepthRouter`-layout mapping (`ResidualConfig.param_shapes`) into the sites."""
        shapes = self.config.param_shapes(self.num_layers, self.dim)
        if set(params) != set(shapes):
            raise ValueError(f"params: expected names {sorted(shapes)}, got {sorted(params)}")
        for name, shape in shapes.items():
            value = torch.as_tensor(params[name])
            if tuple(value.shape) != shape:
                raise ValueError(f"params[{name!r}]: expected shape {shape}, got {tuple(value.shape)}")
            for r in range(shape[0]):
                self.row_parameter(name, r).copy_(value[r])


def _resolve_specs(block: nn.Module, sublayers) -> List[SublayerSpec]:
    if sublayers is None:
        for layout in LAYOUTS.values():
            if all(hasattr(block, a) for pair in layout for a in pair):
                return list(layout)
        raise ValueError(f"sublayers: none of the known layouts {sorted(LAYOUTS)} matches the block "
                         f"(a {type(block).__name__} with children {[n for n, _ in block.named_children()]}); "
                         "pass sublayers=[(norm_attr, fn_attr), ...] or callables (block, h, **kw) -> v")
    if isinstance(sublayers, str):
        if sublayers not in LAYOUTS:
            raise ValueError(f"sublayers: unknown layout {sublayers!r}; known: {sorted(LAYOUTS)}")
        return list(LAYOUTS[sublayers])
    specs = list(sublayers)
    if not specs:
        raise ValueError("sublayers: expected at least one sublayer per block")
    for spec in specs:
        if isinstance(spec, tuple):
            if len(spec) != 2 or not all(isinstance(a, str) for a in spec):
                raise TypeError(f"sublayers: a tuple spec is (norm_attr, fn_attr), got {spec!r}")
            for a in spec:
                if not hasattr(block, a):
                    raise ValueError(f"sublayers: the block ({type(block).__name__}) has no attribute {a!r}")
        elif not callable(spec):
            raise TypeError(f"sublayers: expected (norm_attr, fn_attr) tuples or callables, got {spec!r}")
    return specs


def _model_dtype(blocks: Sequence[nn.Module]) -> torch.dtype:
    for b in blocks:
        for p in b.parameters():
            if p.is_floating_point():
                return p.dtype
    return torch.float32


def param_dtype(blocks: Sequence[nn.Module], dtype) -> torch.dtype:
    """The residual parameters' dtype: a torch dtype as given, "model" (the blocks' parameter
    dtype) or None (float32)."""
    if dtype == "model":
        return _model_dtype(blocks)
    if dtype is None:
        return torch.float32
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, 'model' or None, got {dtype!r}")
    return dtype


def norm_dim(norm: nn.Module) -> Optional[int]:
    """The D a norm module normalizes (its `normalized_shape`, else its 1-D weight), or None."""
    shape = getattr(norm, "normalized_shape", None)
    if shape:
        return int(shape[-1])
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return int(weight.shape[0])
    return None


def _infer_dim(block: nn.Module, specs) -> int:
    for spec in specs:
        if isinstance(spec, tuple):
            dim = norm_dim(getattr(block, spec[0]))
            if dim is not None:
                return dim
    raise ValueError("dim: cannot infer D from the blocks' norms; pass dim=")


class AttnResStack(nn.Module):
    """The user's PreNorm blocks with AttnRes wiring (built by `wrap_prenorm`).

    forward(h `[..., D]`, *, output_hidden_states=False, mix=None, scale=None, **kwargs) -> the
    stack's output `[..., D]` before the model's final norm; with output_hidden_states, also a
    tuple of n + 1 states: the input of each block's first sublayer (the depth-attended state it
    normalizes, the PreNorm model's hidden state at that point) and the output.  kwargs go to
    callable sublayer specs (e.g. an attention mask).
    """

    def __init__(self, blocks: nn.ModuleList, specs: List[SublayerSpec], router: DepthRouter,
                 output_site: Optional[DepthSite]):
        super().__init__()
        self.blocks = blocks
        self.specs = specs
        self.router = router if output_site is None else None
        if output_site is not None:
            self.attnres_output = output_site
            object.__setattr__(self, "_router", router)  # refers to sites the blocks own

    @property
    def depth_router(self) -> DepthRouter:
        """The router (a `DepthRouter`, or a `PerLayerRouter` over the blocks' sites)."""
        return self.router if self.router is not None else self._router

    def sublayer(self, i: int, j: int, h: torch.Tensor, **kwargs) -> torch.Tensor:
        """Sublayer j of block i applied to h: `fn(norm(h))` (a tuple result: its first item)."""
        block, spec = self.blocks[i], self.specs[j]
        if isinstance(spec, tuple):
            v = getattr(block, spec[1])(getattr(block, spec[0])(h))
        else:
            v = spec(block, h, **kwargs)
        return v[0] if isinstance(v, (tuple, list)) else v

    def layer(self, i: int, stream, **kwargs) -> torch.Tensor:
        """Run block i alone on a stream (`stack.depth_router.stream(embedding)`): push its
        sublayers; returns the input of its first sublayer."""
        first = None
        for j in range(len(self.specs)):
            h = stream.input()
            first = h if first is None else first
            stream.push(self.sublayer(i, j, h, **kwargs))
        return first

    def forward(self, h: torch.Tensor, *, output_hidden_states: bool = False,
                mix: Optional[float] = None, scale: Optional[float] = None, **kwargs):
        stream = self.depth_router.stream(h, mix=mix, scale=scale)
        states = [self.layer(i, stream, **kwargs) for i in range(len(self.blocks))]
        out = stream.output()
        return (out, tuple(states) + (out,)) if output_hidden_states else out


def wrap_prenorm(blocks: Sequence[nn.Module], config: ResidualConfig, dim: Optional[int] = None, *,
                 sublayers=None, per_layer: bool = True,
                 dtype: Union[None, str, torch.dtype] = None,
                 schedule: Optional[str] = None) -> AttnResStack:
    """Wrap a stack of PreNorm blocks (each `x = x + f_j(norm_j(x))` for its sublayers j) into
    AttnRes wiring: every `f_j(norm_j(.))` becomes one sublayer of a `DepthRouter` schedule
    (L = blocks x sublayers per block), the additions are dropped.  The blocks' code and
    parameters are untouched; the returned `AttnResStack` holds the same block objects.

    Args:
      blocks: the blocks, in order (an `nn.ModuleList` is kept as it is).
      config: the residual scheme (e.g. `ResidualConfig(kind="block", block_size=4)`).
      dim: D; None: read from the first norm's `normalized_shape` / weight.
      sublayers: per block, the sublayers in order: a layout name of `LAYOUTS` ("gpt2", "llama",
        "fla", "timm"), a list of `(norm_attr, fn_attr)` pairs and/or callables
        `(block, h, **kwargs) -> v` (for sublayers that need more than `h`, e.g. a mask), or None
        to detect a known layout.
      per_layer: each sublayer owns its parameters (`DepthSite` in `block.attnres[j]`, the output
        row in `stack.attnres_output`); False: one `DepthRouter` (`stack.router`, stacked).
      dtype: the residual parameters' dtype: a torch dtype, "model" (the blocks' parameter
        dtype), or None (float32).
      schedule: as `DepthRouter` ("direct", "two_phase", None: two-phase in eval when allowed).
    """
    if not isinstance(blocks, nn.ModuleList):
        blocks = list(blocks)
        if not all(isinstance(b, nn.Module) for b in blocks):
            raise TypeError("blocks: expected nn.Module blocks")
        blocks = nn.ModuleList(blocks)
    if len(blocks) == 0:
        raise ValueError("blocks: expected at least one block")
    if getattr(config, "fuse_out_norm", False):
        raise ValueError("config: fuse_out_norm=True moves every sublayer's pre-norm gain into the "
                         "scheme (M15), but wrap_prenorm keeps the blocks' own norms (their code is "
                         "untouched); build the model on DepthRouter with sublayers that take the "
                         "normed input, or use fuse_out_norm=False")
    specs = _resolve_specs(blocks[0], sublayers)
    for b in blocks[1:]:
        _resolve_specs(b, specs)
    if dim is None:
        dim = _infer_dim(blocks[0], specs)
    dtype = param_dtype(blocks, dtype)
    L = len(blocks) * len(specs)
    if not per_layer:
        router = DepthRouter(config, L, dim, schedule=schedule).to(dtype)
        return AttnResStack(blocks, specs, router, None)
    for b in blocks:
        if hasattr(b, "attnres"):
            raise ValueError(f"blocks: a {type(b).__name__} already has an 'attnres' attribute "
                             "(wrapped twice?)")
    sites = make_sites(config, L, dim, dtype)
    for i, b in enumerate(blocks):
        b.add_module("attnres", nn.ModuleList(sites[i * len(specs):(i + 1) * len(specs)]))
    router = PerLayerRouter(config, L, dim, schedule, sites=sites)
    return AttnResStack(blocks, specs, router, sites[L])
