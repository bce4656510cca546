"""Explicit adapters from our depth-attention read to each peer library's call (issue 13, item 3).

Our read: N sources `[T, D]` (one dtype), a shared query `[D]` (fp32), a key-norm gain `[D]`
(fp32) or None, `eps`, `scale`; out `[T, D] = sum_i softmax_i(scale * <rmsnorm(x_i) * g, q>) x_i`
(spec M1, M2).  Each adapter maps that to one peer's documented signature (read from the peer's
released wheel, versions in `PEER_VERSIONS`) and says, through `Unsupported`, which calls the peer
cannot express; the harness prints that reason and skips the peer at that shape, never silently.

Algebra the adapters use (exact in real arithmetic, one fp32 rounding in practice):
- the gain folds into the query, `<rmsnorm(x) * g, q> = <rmsnorm(x), g * q>` (peers without a
  key-norm weight get `q * g`);
- the scale folds into the query, `scale * <k, q> = <k, scale * q>` (peers without `scale`).
A peer that needs a bf16 query (fast-attnres) gets `(scale * q * g)` rounded to bf16 once: that
rounding is a semantic difference, stated in `notes`.

Everything an adapter does before the call (stacking `[N, T, D]`, folding, casts, making leaves
that require grad) happens in `prepare`, outside the timed region, for every peer alike; the
timed call is `forward(prep)` (and autograd on its output).

Peers are optional: `load()` raises `Unsupported("not importable: ...")`.  `PEER_SITE` is the
folder `bench/fetch_peers.sh` fills with the peers' pure-Python wheels; `add_peer_site()` puts it
on `sys.path` (the GPU machine has no network).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

PEER_SITE = Path(__file__).resolve().parents[1] / ".peers" / "site"
PEER_VERSIONS = {"fla-core": "0.6.0", "liger-kernel": "0.8.5", "fast-attnres": "2.1.0",
                 "flash-attn-res": "0.1.12"}


def add_peer_site(path: Path = PEER_SITE) -> bool:
    """Put the downloaded peers' folder first on sys.path (True when it exists)."""
    if path.is_dir() and str(path) not in sys.path:
        sys.path.insert(0, str(path))
    return path.is_dir()


class Unsupported(Exception):
    """The peer cannot compute this call (not importable, a semantic it lacks, a shape limit);
    str(e) is the reason the report prints."""


@dataclass
class Inputs:
    """One depth-attention read: sources N x `[T, D]`, query `[D]`, gain `[D]` or None."""
    sources: List[Any]
    query: Any
    gain: Optional[Any]
    eps: float = 1e-6
    scale: float = 1.0

    @property
    def dim(self) -> int:
        return self.sources[0].shape[-1]


@dataclass
class Prepared:
    """What `prepare` built (untimed): call arguments and the autograd leaves of the call."""
    args: tuple
    kwargs: Dict[str, Any] = field(default_factory=dict)
    leaves: List[Any] = field(default_factory=list)
    out_shape: tuple = ()


def naive(sources, q, g, eps=1e-6, scale=1.0):
    """The op composed from eager PyTorch ops (stacks the sources; fp32 math), spec M1/M2.
    sources N x `[T, D]`, q `[D]`, g `[D]` or None -> (out `[T, D]` in the sources' dtype,
    lse `[T]` fp32)."""
    import torch
    x = torch.stack(list(sources)).float()                             # [N, T, D]
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    w = q.float() if g is None else q.float() * g.float()
    z = scale * (x * r * w).sum(-1)                                    # [N, T]
    out = (torch.softmax(z, 0).unsqueeze(-1) * x).sum(0)
    return out.to(sources[0].dtype), torch.logsumexp(z, 0)


def naive_multi(sources, qs, gs, eps=1e-6, scale=1.0):
    """Phase 1 composed eagerly: S queries `[S, D]` (gains `[S, D]` or None) over the N sources;
    -> (out `[S, T, D]`, lse `[S, T]`)."""
    import torch
    x = torch.stack(list(sources)).float()                             # [N, T, D]
    k = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    w = qs.float() if gs is None else qs.float() * gs.float()          # [S, D]
    z = scale * torch.einsum("ntd,sd->snt", k, w)                      # [S, N, T]
    out = torch.einsum("snt,ntd->std", torch.softmax(z, 1), x)
    return out.to(sources[0].dtype), torch.logsumexp(z, 1)


def naive_merge(out1, lse1, partial, q, g, eps=1e-6, scale=1.0):
    """Phase 2 composed eagerly (spec's online-softmax merge of one more source `partial`)."""
    import torch
    p = partial.float()
    w = q.float() if g is None else q.float() * g.float()
    z = scale * (p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + eps) * w).sum(-1)   # [T]
    lse = torch.logaddexp(lse1, z)
    out = torch.exp(lse1 - lse).unsqueeze(-1) * out1.float() + torch.exp(z - lse).unsqueeze(-1) * p
    return out.to(partial.dtype), lse


class Adapter:
    """One peer.  Subclasses set name/module and implement check/prepare/forward."""
    name = "?"
    module: Optional[str] = None       # what load() imports
    dist: Optional[str] = None         # its distribution (for the version in the report)
    env: Dict[str, str] = {}            # environment the harness sets around every call
    notes = ""                          # semantic differences the report states
    cuda_only = False
    cost = 3                            # run order in gpu_check, cheapest first (compile work)

    def __init__(self):
        self.mod = None

    def load(self):
        if self.mod is None and self.module is not None:
            try:
                self.mod = importlib.import_module(self.module)
            except Exception as e:  # noqa: BLE001 - any import failure means "not available"
                raise Unsupported(f"not importable: {type(e).__name__}: {str(e)[:160]}") from None
        return self.mod

    def check(self, inp: Inputs) -> None:
        """Raise Unsupported when the peer cannot express this call."""
        if self.cuda_only and not inp.sources[0].is_cuda:
            raise Unsupported("CUDA tensors only")

    def prepare(self, inp: Inputs, requires_grad: bool = False) -> Prepared:
        raise NotImplementedError

    def forward(self, prep: Prepared):
        """The timed call; returns out shaped like one source."""
        raise NotImplementedError

    def phase1(self, inp: Inputs, qs, gs):
        raise Unsupported("no phase-1 (multi-query) entry point")

    def merge(self, out1, lse1, partial, q, g, eps, scale):
        raise Unsupported("no phase-2 (merge) entry point")

    @contextlib.contextmanager
    def environment(self):
        old = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _leaf(t, requires_grad):
    return t.detach().requires_grad_(True) if requires_grad else t


def _check_shared_query(inp: Inputs):
    if inp.query.dim() != 1:
        raise Unsupported("per-token queries are not expressible (the peer takes a query [D])")


class Eager(Adapter):
    """`naive`: the composite from eager PyTorch ops (stack inside, as a user would write it)."""
    name = "eager composite"
    cost = 0                            # nothing to compile

    def check(self, inp):
        pass

    def prepare(self, inp, requires_grad=False):
        srcs = [_leaf(s, requires_grad) for s in inp.sources]
        q = _leaf(inp.query, requires_grad)
        g = None if inp.gain is None else _leaf(inp.gain, requires_grad)
        return Prepared((srcs, q, g, inp.eps, inp.scale),
                        leaves=srcs + [q] + ([] if g is None else [g]))

    def _fn(self):
        return naive

    def forward(self, prep):
        src, q, g, eps, scale = prep.args
        return self._fn()(src, q, g, eps, scale)[0]

    def phase1(self, inp, qs, gs):
        return lambda: naive_multi(inp.sources, qs, gs, inp.eps, inp.scale)

    def merge(self, out1, lse1, partial, q, g, eps, scale):
        return lambda: naive_merge(out1, lse1, partial, q, g, eps, scale)


class Compiled(Eager):
    """`torch.compile(naive, dynamic=False)` (one compiled function per shape)."""
    name = "torch.compile composite"
    cost = 2                            # an inductor compile per shape, no autotuning

    def __init__(self):
        super().__init__()
        self._compiled = {}

    def _get(self, fn):
        if fn not in self._compiled:
            import torch
            self._compiled[fn] = torch.compile(fn, dynamic=False)
        return self._compiled[fn]

    def _fn(self):
        return self._get(naive)

    def phase1(self, inp, qs, gs):
        f = self._get(naive_multi)
        return lambda: f(inp.sources, qs, gs, inp.eps, inp.scale)

    def merge(self, out1, lse1, partial, q, g, eps, scale):
        f = self._get(naive_merge)
        return lambda: f(out1, lse1, partial, q, g, eps, scale)


class FLA(Adapter):
    """flash-linear-attention `fla.ops.attnres.fused_attnres(query, residuals, rms_weight,
    output_rms_weight, rms_eps, scale, return_weights, checkpoint_level)`: list of sources (no
    stacking), key-norm weight, scale; our gain -> rms_weight (ones when gain is None), no output
    norm, no weights, its default checkpoint_level=1.  CUDA only (raises on CPU); sources must be
    16-byte aligned (it asserts).  Its reference `naive_attnres` has the same signature."""
    name = "fla fused_attnres"
    module = "fla.ops.attnres"
    dist = "fla-core"
    cuda_only = True
    entry = "fused_attnres"

    def check(self, inp):
        super().check(inp)
        _check_shared_query(inp)
        bad = [i for i, s in enumerate(inp.sources) if s.data_ptr() % 16]
        if bad:
            raise Unsupported(f"sources {bad} not 16-byte aligned (FLA asserts alignment)")

    def prepare(self, inp, requires_grad=False):
        import torch
        g = inp.gain if inp.gain is not None else torch.ones_like(inp.query)
        srcs = [_leaf(s, requires_grad) for s in inp.sources]
        q, g = _leaf(inp.query, requires_grad), _leaf(g, requires_grad)
        # argument order as in fla-core 0.6.0: query, residuals, rms_weight, output_rms_weight,
        # rms_eps, scale, return_weights, checkpoint_level
        return Prepared((q, srcs, g, None, inp.eps, inp.scale, False, 1), leaves=srcs + [q, g])

    def forward(self, prep):
        return getattr(self.mod, self.entry)(*prep.args)


class FLAGluon(FLA):
    """FLA's Gluon backend: the same call with FLA_ATTNRES_GLUON=1 (read by FLA's dispatcher at
    call time).  FLA falls back to its Triton kernel silently when the Gluon verifier rejects a
    call (needs CUDA SM80+ and D * itemsize >= 128, `triton.experimental.gluon`); `check` asks
    that verifier first so a fallback is reported as a skip, not timed under the Gluon name."""
    name = "fla fused_attnres (Gluon)"
    env = {"FLA_ATTNRES_GLUON": "1"}

    def check(self, inp):
        super().check(inp)
        try:
            gluon = importlib.import_module("fla.ops.attnres.backends.gluon")
            backend = gluon.AttnResGluonBackend()
        except Exception as e:  # noqa: BLE001
            raise Unsupported(f"Gluon backend not importable: {type(e).__name__}: {e}") from None
        if not backend.is_available():
            raise Unsupported("triton.experimental.gluon is not available")
        ok, reason = backend.fused_attnres_verifier(inp.query, inp.sources, inp.query)
        if not ok:
            raise Unsupported(f"Gluon verifier rejects the call (FLA would fall back): {reason}")


class Liger(Adapter):
    """Liger-Kernel `liger_attn_res(V, w_query, w_norm, eps)`: stacked V `[N, T, D]` (stacked in
    prepare), key-norm weight, no scale (folded into w_query), eps.  Plain Triton: runs on CPU
    under TRITON_INTERPRET=1.  Whole-row tiles (BLOCK_D = next_pow2(D)); returns no lse."""
    name = "liger attn_res"
    module = "liger_kernel.transformers.functional"
    dist = "liger-kernel"
    cost = 1                            # one Triton compile per shape, no autotuning

    def check(self, inp):
        _check_shared_query(inp)

    def prepare(self, inp, requires_grad=False):
        import torch
        v = _leaf(torch.stack(list(inp.sources)), requires_grad)             # [N, T, D]
        g = inp.gain if inp.gain is not None else torch.ones_like(inp.query)
        w_query = _leaf(inp.query * inp.scale if inp.scale != 1.0 else inp.query, requires_grad)
        w_norm = _leaf(g, requires_grad)
        return Prepared((v, w_query, w_norm, inp.eps), leaves=[v, w_query, w_norm])

    def forward(self, prep):
        return self.mod.liger_attn_res(*prep.args)


class FastAttnRes(Adapter):
    """fast-attnres 2.1 (`import attnres`): `attnres(values, query, *, eps, scale)`, values a
    list of bf16 `[..., D]` sources (no stacking), query bf16 `[D]` (R = D: standard AttnRes), no
    key-norm weight: the query is `(q * g)` rounded to bf16 once (a rounding our fp32 query does
    not have).  CUDA + bf16 only, 1 <= N <= 129, D <= 8192.  Autotunes many configs on the first
    call: the harness's per-peer cap bounds it."""
    name = "fast-attnres"
    module = "attnres"
    dist = "fast-attnres"
    cuda_only = True
    notes = "query (q*g) rounded to bf16 (no key-norm weight)"

    def check(self, inp):
        import torch
        super().check(inp)
        _check_shared_query(inp)
        if inp.sources[0].dtype != torch.bfloat16:
            raise Unsupported(f"bf16 only (got {inp.sources[0].dtype})")
        if not 1 <= len(inp.sources) <= 129 or inp.dim > 8192:
            raise Unsupported(f"envelope 1<=N<=129, D<=8192 (got N={len(inp.sources)}, D={inp.dim})")

    def prepare(self, inp, requires_grad=False):
        import torch
        w = inp.query if inp.gain is None else inp.query * inp.gain
        q = _leaf(w.to(torch.bfloat16), requires_grad)
        srcs = [_leaf(s, requires_grad) for s in inp.sources]
        return Prepared((srcs, q), {"eps": inp.eps, "scale": inp.scale}, leaves=srcs + [q])

    def forward(self, prep):
        return self.mod.attnres(*prep.args, **prep.kwargs)


class FlashAttnRes(Adapter):
    """flash-attn-res 0.1.12 (catswe): two-phase ops, `phase_1_batched_attention_triton_op(
    block_representations [N, B, T, D], pseudo_queries [S, D], eps) -> (out [S, B, T, D] bf16,
    lse [S, B, T])` and `phase_2_online_softmax_merge_triton_op(partial [B, T, D], query [D],
    out1 [B, T, D], lse1 [B, T], eps) -> [B, T, D]`.  No key-norm weight and no scale (both folded
    into the fp32 query), bf16 only, power-of-two D (whole-row `tl.arange(0, D)`).  A single read
    is phase 1 with S = 1 over the stacked sources (B = 1)."""
    name = "flash-attn-res"
    module = "flash_attn_res"
    dist = "flash-attn-res"
    cost = 4                            # autotuned configs that spill, ~30 s each to compile on sm_90

    def check(self, inp):
        import torch
        _check_shared_query(inp)
        d = inp.dim
        if inp.sources[0].dtype != torch.bfloat16:
            raise Unsupported(f"bf16 only (got {inp.sources[0].dtype})")
        if d & (d - 1):
            raise Unsupported(f"power-of-two D only (got D={d})")

    @staticmethod
    def _w(q, g, scale):
        w = q.float() if g is None else q.float() * g.float()
        return w * scale if scale != 1.0 else w

    def prepare(self, inp, requires_grad=False):
        import torch
        t, d = inp.sources[0].reshape(-1, inp.dim).shape
        v = _leaf(torch.stack([s.reshape(1, t, d) for s in inp.sources]), requires_grad)  # [N,1,T,D]
        w = _leaf(self._w(inp.query, inp.gain, inp.scale).reshape(1, d), requires_grad)
        return Prepared((v, w, inp.eps), leaves=[v, w], out_shape=tuple(inp.sources[0].shape))

    def forward(self, prep):
        out, _ = self.mod.phase_1_batched_attention_triton_op(*prep.args)
        return out.reshape(prep.out_shape)

    def phase1(self, inp, qs, gs):
        import torch
        self.check(inp)
        t, d = inp.sources[0].reshape(-1, inp.dim).shape
        v = torch.stack([s.reshape(1, t, d) for s in inp.sources])
        w = (self._w(qs, gs, inp.scale)).contiguous()
        return lambda: self.mod.phase_1_batched_attention_triton_op(v, w, inp.eps)

    def merge(self, out1, lse1, partial, q, g, eps, scale):
        import torch
        t, d = partial.reshape(-1, partial.shape[-1]).shape
        if partial.dtype != torch.bfloat16:
            raise Unsupported(f"bf16 only (got {partial.dtype})")
        if d & (d - 1):
            raise Unsupported(f"power-of-two D only (got D={d})")
        args = (partial.reshape(1, t, d), self._w(q, g, scale), out1.reshape(1, t, d),
                lse1.reshape(1, t), eps)
        return lambda: self.mod.phase_2_online_softmax_merge_triton_op(*args)


def all_adapters() -> List[Adapter]:
    """Every peer (the composites first); gpu_check runs them in `cost` order.  FLA (24 + 24 +
    10 autotuned configs) and fast-attnres (48 + 48) keep the default cost 3."""
    return [Eager(), Compiled(), FLA(), FLAGluon(), Liger(), FastAttnRes(), FlashAttnRes()]
