"""The user's cost at realistic width: train step, peak memory and KV-cache decode of Block and
Full AttnRes against PreNorm on each backend's fastest CPU path.

Models (random weights, vocab 256, MLP ratio 4; L = sublayers = 2 x layers):

* train: torch `AttnResTransformer` (the depth attention dispatched to the C kernel: each worker
  records `attnres_torch.dispatch.impl_counts()` over its timed steps and the table names what
  served), JAX NNX `Transformer` (one `jax.jit` AdamW step, each `--jax-forms` form: "scanned" =
  `scan_layers=True` with its default backward (Full "fused", Block "replay": one more forward
  of each layer in the backward), "scanned-carry" = `scan_backward="scan"` (`lax.scan`'s own
  autodiff, which keeps every step's carry), "unrolled" = `stack_apply`), MLX `attnres_mlx.Transformer` (an
  `mx.compile`d AdamW step with the model and optimizer state as its inputs and outputs).  Every
  step: AdamW (lr 1e-3), next-token cross-entropy on `[B, T + 1]` tokens, backward, update.
* decode, batch 1: prefill P tokens, then one token per call with a KV cache.  torch: the
  `AttnResTransformer` has no KV cache, so torch decodes a transformers `LlamaForCausalLM` of the
  same width and depth (SwiGLU, intermediate 4 d: `bench_memory._hf_llama`) converted by
  `attnres_torch.hf` (PreNorm: the unconverted model), with HF's `DynamicCache`.  MLX:
  `Transformer.compile_step` on a `make_cache` fixed-size cache (`bench_mlx._Decoder`).  JAX: the
  NNX `Transformer` has no KV cache: only the prefill (a jitted forward of `[1, P]`) is measured
  and the per-token cell says so.
* variants: PreNorm (`ResidualConfig` kind "standard"), Full, Block with S = 8 sublayers per block
  (`bench_jax_depth.KINDS`): N = L / 8 blocks plus the embedding, i.e. 4 at L = 32 and the
  paper's N ~ 8 at L = 64.  Decode runs Block twice: direct and two-phase.

Method.  Every variant is a persistent worker process of its framework's interpreter
(.nox/tests-{torch,jax,mlx}); the driver (any Python 3) asks them in turn, one step / token each
(A B C A B C ...), so every ratio is the median of per-round ratios to PreNorm measured seconds
apart under the same load, both of wall time and of the worker's process CPU time (which other
jobs on a shared machine sway less).  Train: `--warmup` steps, then `--steps` timed ones.
Decode: one warm-up prefill, `--prefill-reps` timed ones, 2 warm-up tokens, `--tokens` timed ones.
All variants of a group are alive at once (three models with their AdamW state; `--train-pairs`
keeps two: PreNorm + Full, then PreNorm + Block).  Peak memory, per worker: torch = peak RSS
(VmHWM) minus the RSS after the imports (model, optimizer state, activations, allocator slack),
and for training also `experiments.probes.training_memory` (16 B per parameter + the tensors
autograd saves, each storage once); JAX = `compiled.memory_analysis()` (arguments + outputs -
aliased + temporaries), the RSS beside it; MLX = `mx.get_peak_memory()`.  Where a ratio exceeds
the paper's overhead (< 4 % train, < 2 % inference), `--profile auto` profiles every variant of
the group: torch `torch.profiler` self time by category (one step; decode: 8 tokens), JAX the
compiled step's HLO instruction counts and `cost_analysis()` flops / bytes, MLX the primitives
of one eager step's graph (`mx.export_to_dot`).

    python bench/bench_cost.py --json bench/results/cost.json            # d 1024, L 32, all three
    python bench/bench_cost.py --frameworks torch --layers 64 --train-pairs
    python bench/bench_cost.py --quick --frameworks torch --json /tmp/c.json   # smoke

The mlx-cpu wheel on Linux links a reference BLAS, far slower at matmuls than torch's or XLA's,
so MLX trains at `--mlx-batch` x `--mlx-seq` and prefills `--mlx-prefill` tokens (the table
gives its shapes), and its slow matmuls dilute every other cost.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FRAMEWORKS = ("torch", "jax", "mlx")
TRAIN_VARIANTS = ("prenorm", "full", "block")
DECODE_VARIANTS = ("prenorm", "full", "block-direct", "block-two_phase")
#: The paper's overheads of Block AttnRes over the PreNorm baseline (arXiv 2603.15031).
PAPER = {"train": 0.04, "inference": 0.02}
BLOCK_SIZE = 8  # bench_jax_depth.KINDS["block"]


def _bench_module(name: str):
    """A sibling bench script as a module (their helpers are reused, not copied)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return __import__(name)


def _kind(variant: str):
    return _bench_module("bench_jax_depth").KINDS[variant.split("-")[0]]


def _schedule(variant: str) -> str:
    return variant.split("-")[1] if "-" in variant else "direct"


def _status(field: str) -> int:
    return _bench_module("bench_memory")._status(field)


def _rss_peak(base: int) -> dict:
    return {"peak_bytes": _status("VmHWM") - base, "rss_peak_bytes": _status("VmHWM"),
            "rss_base_bytes": base}


# ---------------------------------------------------------------------------------------------
# workers: one variant each; `info`, `step()` (seconds), `prefill()` (decode), `memory()`,
# `profile()`


def _torch_categories(events, wall_s: float) -> dict:
    """Self time (ms) of one profiled step by category; "outside ops" = wall - every op's self time
    (Python: the router's stream, autograd's engine bookkeeping, the optimizer loop)."""
    cats = {"depth attention (attnres ops)": 0.0, "matmul": 0.0, "sdpa": 0.0, "norms": 0.0,
            "copies / allocation": 0.0, "elementwise / other aten": 0.0,
            "autograd nodes / other": 0.0}
    copies = {"aten::copy_", "aten::cat", "aten::stack", "aten::clone", "aten::empty",
              "aten::empty_like", "aten::empty_strided", "aten::zeros", "aten::zero_", "aten::fill_",
              "aten::contiguous", "aten::new_empty", "aten::new_zeros", "aten::zeros_like",
              "aten::resize_", "aten::to", "aten::_to_copy", "aten::index_select"}
    matmul = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm"}
    total = 0.0
    for e in events:
        n, ms = e.key, e.self_cpu_time_total / 1e3
        total += ms
        if n.startswith("attnres::"):
            cats["depth attention (attnres ops)"] += ms
        elif n in matmul:
            cats["matmul"] += ms
        elif "scaled_dot_product" in n or "flash_attention" in n:
            cats["sdpa"] += ms
        elif "rms_norm" in n or "layer_norm" in n:
            cats["norms"] += ms
        elif n in copies:
            cats["copies / allocation"] += ms
        elif n.startswith("aten::"):
            cats["elementwise / other aten"] += ms
        else:
            cats["autograd nodes / other"] += ms
    cats["outside ops (Python)"] = max(0.0, 1e3 * wall_s - total)
    cats = {k: round(v, 2) for k, v in cats.items()}
    cats["wall"] = round(1e3 * wall_s, 2)
    return cats


def _torch_profile(fn, reps: int = 1) -> dict:
    """`reps` calls of `fn` under torch.profiler: self time per call by category."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        wall = time.perf_counter() - t0
    ms = {k: round(v / reps, 3) for k, v in _torch_categories(prof.key_averages(), wall).items()}
    per = "" if reps == 1 else f", mean of {reps} calls"
    return {"method": f"torch.profiler self CPU time (ms{per})", "ms": ms}


class TorchTrain:
    def __init__(self, a):
        import torch
        from attnres_torch import dispatch
        from attnres_torch.modules import AttnResTransformer

        torch.set_num_threads(a.threads)
        self.base = _status("VmRSS")
        torch.manual_seed(0)
        self.vocab = a.vocab
        self.model = AttnResTransformer(a.vocab, a.dim, a.layers // 2, a.heads, _kind(a.variant))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
        before = dispatch.impl_counts()
        for _ in range(a.warmup):
            self._step()
        counts = dispatch.impl_counts() - before
        last = dispatch.last_choice()
        self.dispatch, self.counts0 = dispatch, dispatch.impl_counts()
        self.info = {"model": "AttnResTransformer", "path": "eager, C kernel" if "cpu_c" in counts else "eager",
                     "params": sum(p.numel() for p in self.model.parameters()),
                     "impl_counts_warmup": dict(counts), "last_choice": None if last is None else last._asdict(),
                     "threads": torch.get_num_threads(), "version": torch.__version__}

    def _forward_backward(self):
        import torch.nn.functional as F

        self.opt.zero_grad(set_to_none=True)
        logits = self.model(self.tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, self.vocab), self.tokens[:, 1:].reshape(-1)).backward()

    def _step(self):
        self._forward_backward()
        self.opt.step()

    def step(self):
        t0 = time.perf_counter()
        self._step()
        return time.perf_counter() - t0

    def memory(self):
        if str(ROOT) not in sys.path:  # the checkout's experiments/ (no wheel ships it)
            sys.path.insert(0, str(ROOT))
        from experiments.probes import training_memory

        out = _rss_peak(self.base)  # read before the probe's extra pass
        out["method"] = "peak RSS (VmHWM) - RSS after imports"
        probe = training_memory(self.model, self.tokens)
        out.update(state_bytes=probe["state"], saved_activation_bytes=probe["activations"])
        out["impl_counts_timed"] = dict(self.dispatch.impl_counts() - self.counts0)
        return out

    def profile(self):
        """Forward + backward profiled; the optimizer step (AdamW's per-parameter loop) timed
        apart and added as its own line."""
        out = _torch_profile(self._forward_backward)
        t0 = time.perf_counter()
        self.opt.step()
        out["ms"]["AdamW step (timed apart)"] = round(1e3 * (time.perf_counter() - t0), 2)
        return out


class TorchDecode:
    def __init__(self, a):
        import torch
        from attnres_torch import dispatch, hf

        torch.set_num_threads(a.threads)
        self.base = _status("VmRSS")
        torch.manual_seed(0)
        ns = SimpleNamespace(dim=a.dim, depth=a.layers, heads=a.heads,
                             context=a.prefill + a.tokens + 24)  # + warm-up and profiled tokens
        self.model = _bench_module("bench_memory")._hf_llama(ns, _kind(a.variant))[0].eval()
        if a.variant != "prenorm":
            hf.router(self.model).schedule = _schedule(a.variant)
        g = torch.Generator().manual_seed(0)
        self.prompt = torch.randint(0, 256, (1, a.prefill), generator=g)
        self.torch, self.dispatch = torch, dispatch
        # "compiled": transformers' StaticCache and one torch.compile'd decode step (inductor,
        # static shapes: the cache position is a tensor input), compiled at the warm-up token
        self.compiled = a.form == "compiled"
        self.forward = torch.compile(self.model, dynamic=False) if self.compiled else self.model
        self.static = None  # one cache object for every prefill (a new object would recompile)
        if self.compiled:
            from transformers import StaticCache

            self.static = StaticCache(config=self.model.config, max_cache_len=ns.context)
        before = dispatch.impl_counts()
        self.prefill()  # warm-up
        self.step()
        self.counts0 = dispatch.impl_counts()
        counts = self.counts0 - before
        last = dispatch.last_choice()
        self.info = {"model": "transformers LlamaForCausalLM" + ("" if a.variant == "prenorm" else
                                                                  ", converted by attnres_torch.hf"),
                     "path": ("torch.compile'd step (its T = 1 reads traced as the composition: "
                              "dispatch.COMPILED_ROWS_MAX), StaticCache, eager prefill (counted)"
                              if self.compiled else "eager, DynamicCache"),
                     "kv_cache": True, "impl_counts_warmup": dict(counts),
                     "params": sum(p.numel() for p in self.model.parameters()),
                     "last_choice": None if last is None or a.variant == "prenorm" else last._asdict(),
                     "threads": torch.get_num_threads(), "version": torch.__version__}

    def prefill(self):
        with self.torch.no_grad():
            t0 = time.perf_counter()
            if self.static is not None:  # the eager prefill refills the static cache
                self.static.reset()
            out = self.model(input_ids=self.prompt, cache=self.static, use_cache=True)
            self.cache, self.tok, self.pos = out.cache, out.logits[:, -1:].argmax(-1), self.prompt.shape[1]
            return time.perf_counter() - t0

    def step(self):
        with self.torch.no_grad():
            t0 = time.perf_counter()
            if self.compiled:
                pos = self.torch.tensor([self.pos])
                out = self.forward(input_ids=self.tok, cache=self.cache, use_cache=True, position_ids=pos[None],
                                   cache_position=pos)
            else:
                out = self.model(input_ids=self.tok, cache=self.cache, use_cache=True)
            self.cache, self.tok, self.pos = out.cache, out.logits[:, -1:].argmax(-1), self.pos + 1
            return time.perf_counter() - t0

    def memory(self):
        out = _rss_peak(self.base)
        out["method"] = "peak RSS (VmHWM) - RSS after imports"
        out["impl_counts_timed"] = dict(self.dispatch.impl_counts() - self.counts0)
        return out

    def profile(self):
        with self.torch.no_grad():
            _torch_profile(self.step)  # the profiler's first use in a process costs more
            return _torch_profile(self.step, reps=8)


def _hlo_counts(text: str) -> dict:
    """Instruction counts by opcode in an HLO module's text (the compiled step)."""
    import re

    counts: dict = {}
    for m in re.finditer(r"=\s*[^=]*?\s([a-z][a-z0-9-]*)\(", text):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return {"instructions": sum(counts.values()), "by_opcode": dict(sorted(counts.items(), key=lambda kv: -kv[1]))}


def _jax_analysis(compiled) -> dict:
    ma = compiled.memory_analysis()
    mem = {k: int(getattr(ma, k + "_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    mem["peak_bytes"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return mem, {"flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
                 **_hlo_counts(compiled.as_text())}


#: XLA's cost analysis counts a while loop's body once, whatever its trip count.
_SCAN_NOTE = {"scanned": " (the scanned layers' loop body counted once)", "unrolled": "",
              "scanned-carry": " (the scanned layers' loop body counted once)"}


class JaxTrain:
    def __init__(self, a):
        import jax
        import jax.numpy as jnp
        import numpy as np
        import optax
        from attnres_jax import dispatch
        from attnres_jax.modules import Transformer
        from flax import nnx

        self.base = _status("VmRSS")
        forms = _bench_module("bench_jax_depth").FORMS
        model = Transformer(_kind(a.variant), vocab_size=a.vocab, dim=a.dim, num_blocks=a.layers // 2,
                            num_heads=a.heads, rngs=nnx.Rngs(0), **forms[a.form])
        graphdef, self.params = nnx.split(model)
        tx = optax.adamw(1e-3)
        self.opt_state = tx.init(self.params)
        self.tokens = jnp.asarray(np.random.default_rng(0).integers(0, a.vocab, (a.batch, a.seq + 1)))

        step = _bench_module("bench_jax_depth").adamw_step(graphdef, tx)

        before = dispatch.impl_counts()
        t0 = time.perf_counter()
        self.compiled = jax.jit(step, donate_argnums=(0, 1)).lower(self.params, self.opt_state,
                                                                   self.tokens).compile()
        compile_s = time.perf_counter() - t0
        self.mem, self.cost = _jax_analysis(self.compiled)
        self.jax, self.form = jax, a.form
        for _ in range(a.warmup):
            self.step()
        last = dispatch.last_choice()
        self.info = {"model": "NNX Transformer", "path": f"jit, {a.form}", "compile_s": compile_s,
                     "params": sum(x.size for x in jax.tree.leaves(self.params)),
                     "impl_counts_traced": dict(dispatch.impl_counts() - before),
                     "last_choice": None if last is None else last._asdict(),
                     "version": jax.__version__, "devices": str(jax.devices())}

    def step(self):
        t0 = time.perf_counter()
        value, self.params, self.opt_state = self.compiled(self.params, self.opt_state, self.tokens)
        self.jax.block_until_ready((value, self.params, self.opt_state))
        return time.perf_counter() - t0

    def memory(self):
        out = dict(self.mem, method="compiled.memory_analysis(): argument + output - alias + temp")
        out.update({"rss_" + k: v for k, v in _rss_peak(self.base).items()})
        return out

    def profile(self):
        return {"method": "compiled step: cost_analysis() and HLO instruction counts" + _SCAN_NOTE[self.form],
                **self.cost}


class JaxPrefill:
    """The NNX Transformer has no KV cache: only the prompt's jitted forward."""

    def __init__(self, a):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from attnres_jax import dispatch
        from attnres_jax.modules import Transformer
        from flax import nnx

        self.base = _status("VmRSS")
        forms = _bench_module("bench_jax_depth").FORMS
        model = Transformer(_kind(a.variant), vocab_size=a.vocab, dim=a.dim, num_blocks=a.layers // 2,
                            num_heads=a.heads, rngs=nnx.Rngs(0), **forms[a.form])
        graphdef, self.params = nnx.split(model)
        schedule = _schedule(a.variant)
        self.prompt = jnp.asarray(np.random.default_rng(0).integers(0, a.vocab, (1, a.prefill)))

        def forward(params, tokens):
            return nnx.merge(graphdef, params)(tokens, schedule=schedule)[:, -1].argmax(-1)

        before = dispatch.impl_counts()
        t0 = time.perf_counter()
        self.compiled = jax.jit(forward).lower(self.params, self.prompt).compile()
        compile_s = time.perf_counter() - t0
        self.mem, self.cost = _jax_analysis(self.compiled)
        self.jax, self.form = jax, a.form
        last = dispatch.last_choice()
        self.info = {"model": "NNX Transformer", "path": f"jit forward, {a.form}", "kv_cache": False,
                     "compile_s": compile_s, "impl_counts_traced": dict(dispatch.impl_counts() - before),
                     "last_choice": None if last is None else last._asdict(), "version": jax.__version__}

    def prefill(self):
        t0 = time.perf_counter()
        self.jax.block_until_ready(self.compiled(self.params, self.prompt))
        return time.perf_counter() - t0

    def step(self):
        raise ValueError("the JAX Transformer has no KV cache: no per-token decode")

    def memory(self):
        out = dict(self.mem, method="compiled.memory_analysis(): argument + output - alias + temp")
        out.update({"rss_" + k: v for k, v in _rss_peak(self.base).items()})
        return out

    def profile(self):
        return {"method": "compiled forward: cost_analysis() and HLO instruction counts" + _SCAN_NOTE[self.form],
                **self.cost}


def _mlx_graph_counts(*outputs) -> dict:
    """Primitives of the (unevaluated) graph of `outputs`, by name (`mx.export_to_dot`)."""
    import re

    import mlx.core as mx

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        text = Path(f.name).read_text()
    counts: dict = {}
    for m in re.finditer(r'label\s*=\s*"([A-Za-z][A-Za-z0-9_]*)', text):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return {"primitives": sum(counts.values()), "by_primitive": dict(sorted(counts.items(), key=lambda kv: -kv[1]))}


def _mlx_fused(model, tokens_shape) -> bool:
    """Whether the router reads through its fused path (`attnres_mlx.residual_ops.fusable`, no
    dispatch call recorded) for tokens of `tokens_shape` `[B, T]`."""
    import mlx.core as mx

    try:
        from attnres_mlx.residual_ops import fusable
    except ImportError:  # a router without fused reads
        return False
    router = model.router
    embedding = mx.zeros((*tokens_shape, router.dim))
    return bool(getattr(router, "fused_reads", False) and fusable(router.config, embedding, router.num_layers))


class MlxTrain:
    def __init__(self, a):
        import mlx.core as mx
        import mlx.nn as nn
        import mlx.optimizers as optim
        import numpy as np
        from attnres_mlx import Transformer, dispatch

        self.base = _status("VmRSS")
        mx.random.seed(0)
        self.model = model = Transformer(_kind(a.variant), vocab_size=a.vocab, dim=a.dim,
                                         num_blocks=a.layers // 2, num_heads=a.heads)
        mx.eval(model.parameters())
        self.opt = opt = optim.AdamW(learning_rate=1e-3)
        opt.init(model.trainable_parameters())
        tokens = mx.array(np.random.default_rng(0).integers(0, a.vocab, (a.batch, a.seq + 1)))
        self.x, self.y = tokens[:, :-1], tokens[:, 1:]

        def loss_fn(model, x, y):
            return nn.losses.cross_entropy(model(x)[0], y).mean()

        self.loss_and_grad = nn.value_and_grad(model, loss_fn)
        self.state = [model.state, opt.state]

        def step(x, y):
            loss, grads = self.loss_and_grad(model, x, y)
            opt.update(model, grads)
            return loss

        self.mx, self.compiled = mx, True
        before = dispatch.impl_counts()
        try:
            self.fn = mx.compile(step, inputs=self.state, outputs=self.state)
            t0 = time.perf_counter()
            self.step()
        except Exception as e:  # an mx.compile refusal: say so and step eagerly
            self.compiled, self.error = False, f"{type(e).__name__}: {e}"
            self.fn = step
            t0 = time.perf_counter()
            self.step()
        first = time.perf_counter() - t0
        for _ in range(max(0, a.warmup - 1)):
            self.step()
        last = dispatch.last_choice()
        self.info = {"model": "attnres_mlx.Transformer", "fused_reads": _mlx_fused(model, (a.batch, a.seq)),
                     "path": "mx.compile step" if self.compiled else "eager (mx.compile failed)",
                     "first_step_s": first, "impl_counts_warmup": dict(dispatch.impl_counts() - before),
                     "last_choice": None if last is None else last._asdict(), "version": mx.__version__}
        if not self.compiled:
            self.info["compile_error"] = self.error

    def step(self):
        t0 = time.perf_counter()
        loss = self.fn(self.x, self.y)
        self.mx.eval(loss, self.state)
        return time.perf_counter() - t0

    def memory(self):
        return {"peak_bytes": int(self.mx.get_peak_memory()), "active_bytes": int(self.mx.get_active_memory()),
                "method": "mx.get_peak_memory()", **{"rss_" + k: v for k, v in _rss_peak(self.base).items()}}

    def profile(self):
        loss, grads = self.loss_and_grad(self.model, self.x, self.y)  # eager graph, unevaluated
        return {"method": "primitives of one eager step's graph (mx.export_to_dot)", **_mlx_graph_counts(loss, grads)}


class MlxDecode:
    def __init__(self, a):
        import mlx.core as mx
        from attnres_mlx import Transformer, dispatch

        self.base = _status("VmRSS")
        mx.random.seed(0)
        model = Transformer(_kind(a.variant), vocab_size=a.vocab, dim=a.dim, num_blocks=a.layers // 2,
                            num_heads=a.heads)
        mx.eval(model.parameters())
        self.max_len = a.prefill + a.tokens + 24  # + warm-up tokens
        self.dec = _bench_module("bench_mlx")._Decoder(model, "compiled", _schedule(a.variant), a.prefill,
                                                       self.max_len)  # the first prefill (traces)
        self.model, self.mx = model, mx
        self.prompt = mx.array([[1] * a.prefill])
        before = dispatch.impl_counts()
        self.step()  # traces the T = 1 step
        last = dispatch.last_choice()
        self.info = {"model": "attnres_mlx.Transformer", "path": "compile_step, make_cache", "kv_cache": True,
                     "fused_reads": {"token": _mlx_fused(model, (1, 1)), "prefill": _mlx_fused(model, (1, a.prefill))},
                     "impl_counts_warmup": dict(dispatch.impl_counts() - before),
                     "last_choice": None if last is None else last._asdict(), "version": mx.__version__}

    def prefill(self):
        mx, d = self.mx, self.dec
        t0 = time.perf_counter()
        logits, d.cache = d.fn(self.prompt, self.model.make_cache(1, self.max_len), mx.array(0))
        d.tok = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(d.tok, d.cache)
        d.pos = self.prompt.shape[1]
        return time.perf_counter() - t0

    def step(self):
        t = self.dec.step()
        return t[0] if isinstance(t, tuple) else t  # bench_mlx's _Decoder: (wall, CPU) seconds

    def memory(self):
        return {"peak_bytes": int(self.mx.get_peak_memory()), "method": "mx.get_peak_memory()",
                **{"rss_" + k: v for k, v in _rss_peak(self.base).items()}}

    def profile(self):
        d, mx = self.dec, self.mx
        logits, _ = self.model(d.tok, d.cache, offset=mx.array(d.pos), schedule=d.schedule)  # eager, unevaluated
        return {"method": "primitives of one eager token's graph (mx.export_to_dot)", **_mlx_graph_counts(logits)}


WORKERS = {("torch", "train"): TorchTrain, ("torch", "decode"): TorchDecode, ("jax", "train"): JaxTrain,
           ("jax", "decode"): JaxPrefill, ("mlx", "train"): MlxTrain, ("mlx", "decode"): MlxDecode}


def worker_main(a) -> None:
    """Line protocol: the first line is {"info"} (or {"error"}); then {"cmd": "step" | "prefill" |
    "memory" | "profile" | "quit"} -> {"s"} | {"memory"} | {"profile"} | {"error"}."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr; the protocol keeps the real stdout
    sys.stdout = sys.stderr

    def reply(obj):
        proto.write(json.dumps(obj) + "\n")

    try:
        w = WORKERS[a.framework, a.task](a)
        reply({"info": w.info})
    except Exception:
        reply({"error": traceback.format_exc()})
        return
    for line in sys.stdin:
        cmd = json.loads(line)["cmd"]
        if cmd == "quit":
            break
        try:
            if cmd in ("step", "prefill"):
                c0 = time.process_time()
                wall = getattr(w, cmd)()
                reply({"s": wall, "cpu": time.process_time() - c0})
            else:
                reply({cmd: getattr(w, cmd)()})
        except Exception:
            reply({"error": traceback.format_exc()})


# ---------------------------------------------------------------------------------------------
# driver


class Worker:
    def __init__(self, python: str, framework: str, task: str, variant: str, s: dict, form: str = "-"):
        self.name = f"{framework}/{task}/{form}/{variant}"
        self.log = tempfile.TemporaryFile("w+")
        cmd = [python, str(Path(__file__).resolve()), "--worker", framework, task, variant, form,
               json.dumps(s)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, cwd=str(ROOT))

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"worker {self.name} died (exit {self.proc.wait()}):\n{self.log.read()[-3000:]}")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"worker {self.name}: {msg['error']}")
        return msg

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _per_round(times: dict, base: str) -> dict:
    """Median over rounds of time / PreNorm's time of the same round, per variant."""
    return {v: statistics.median(t / b for t, b in zip(ts, times[base])) for v, ts in times.items()}


def _loadavg() -> str:
    return _bench_module("bench_user_loop").loadavg()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _start(python, framework, task, variants, s, form):
    """Start one worker per variant (their imports, compiles and warm-ups overlap; nothing is
    timed until every one is ready)."""
    workers = []
    try:
        for v in variants:
            workers.append(Worker(python, framework, task, v, s, form))
            workers[-1].variant = v
        for w in workers:
            w.info = w.read()["info"]
            _log(f"  ready {w.name}: {w.info.get('path')}, impl "
                 f"{w.info.get('impl_counts_warmup', w.info.get('impl_counts_traced', {}))}")
    except BaseException:
        for w in workers:
            w.close()
        raise
    return workers


def _profile_all(workers, exceeded: bool, mode: str) -> dict:
    if mode == "never" or (mode == "auto" and not exceeded):
        return {}
    return {w.variant: w.ask("profile")["profile"] for w in workers}


def measure_train(python, framework, s, args, form) -> dict:
    """PreNorm, Full and Block interleaved; with `--train-pairs` (three models' optimizer state
    do not fit) PreNorm + Full, then PreNorm + Block, each pair interleaved, each ratio to its own
    pair's PreNorm (the second PreNorm's steps are kept in the Block row as baseline_steps_s)."""
    if not args.train_pairs or len(args.train_variants) < len(TRAIN_VARIANTS):
        return {"rows": _train_group(python, framework, s, args, form, tuple(args.train_variants))}
    first = _train_group(python, framework, s, args, form, ("prenorm", "full"))
    second = {r["variant"]: r for r in _train_group(python, framework, s, args, form, ("prenorm", "block"))}
    block = dict(second["block"], baseline_steps_s=second["prenorm"]["steps_s"],
                 baseline_peak_bytes=second["prenorm"]["peak_bytes"])
    return {"rows": first + [block]}


def _train_group(python, framework, s, args, form, variants) -> list:
    workers = _start(python, framework, "train", variants, s, form)
    try:
        times = {v: [] for v in variants}
        cpu = {v: [] for v in variants}
        for r in range(s["steps"]):
            for w in workers:
                time.sleep(args.gap)  # the previous worker's pool threads park
                t = w.ask("step")
                times[w.variant].append(t["s"])
                cpu[w.variant].append(t["cpu"])
            _log(f"  round {r + 1}: " + ", ".join(f"{v} {t[-1]:.2f} s" for v, t in times.items()))
        memory = {w.variant: w.ask("memory")["memory"] for w in workers}
        ratio, cpu_ratio = _per_round(times, "prenorm"), _per_round(cpu, "prenorm")
        prof = _profile_all(workers, max(ratio.values()) > 1 + PAPER["train"], args.profile)
    finally:
        for w in workers:
            w.close()
    rows = []
    for w in workers:
        v, m = w.variant, memory[w.variant]
        rows.append({"framework": framework, "form": form, "layers": s["layers"], "dim": s["dim"],
                     "batch": s["batch"], "seq": s["seq"], "variant": v,
                     "step_s": statistics.median(times[v]), "steps_s": times[v], "step_ratio": ratio[v],
                     "steps_cpu_s": cpu[v], "step_cpu_ratio": cpu_ratio[v],
                     "peak_bytes": m["peak_bytes"], "memory_ratio": m["peak_bytes"] / memory["prenorm"]["peak_bytes"],
                     "memory": m, "info": w.info, "profile": prof.get(v), "alive": list(variants)})
    return rows


def measure_decode(python, framework, s, args, form) -> dict:
    variants = [v for v in DECODE_VARIANTS if not (framework == "jax" and form != "unrolled" and "two_phase" in v)]
    workers = _start(python, framework, "decode", variants, s, form)
    has_cache = framework != "jax"
    try:
        prefill, prefill_cpu = {v: [] for v in variants}, {v: [] for v in variants}
        tokens, tokens_cpu = {v: [] for v in variants}, {v: [] for v in variants}
        for r in range(s["prefill_reps"] + (1 if has_cache else 0)):  # JAX warmed up at compile
            for w in workers:
                time.sleep(args.gap)
                t = w.ask("prefill")
                if r or not has_cache:
                    prefill[w.variant].append(t["s"])
                    prefill_cpu[w.variant].append(t["cpu"])
        if has_cache:
            for _ in range(2):  # warm-up tokens
                for w in workers:
                    w.ask("step")
            for _ in range(s["tokens"]):
                for w in workers:
                    time.sleep(args.token_gap)
                    t = w.ask("step")
                    tokens[w.variant].append(t["s"])
                    tokens_cpu[w.variant].append(t["cpu"])
        memory = {w.variant: w.ask("memory")["memory"] for w in workers}
        pr = _per_round(prefill, "prenorm")
        tr = _per_round(tokens, "prenorm") if has_cache else {}
        pr_cpu = _per_round(prefill_cpu, "prenorm")
        tr_cpu = _per_round(tokens_cpu, "prenorm") if has_cache else {}
        worst = max(list(pr.values()) + list(tr.values()))
        prof = _profile_all(workers, worst > 1 + PAPER["inference"], args.profile)
    finally:
        for w in workers:
            w.close()
    rows = []
    for w in workers:
        v, m = w.variant, memory[w.variant]
        rows.append({"framework": framework, "form": form, "layers": s["layers"], "dim": s["dim"],
                     "prefill": s["prefill"], "variant": v, "kv_cache": has_cache,
                     "prefill_s": statistics.median(prefill[v]), "prefills_s": prefill[v], "prefill_ratio": pr[v],
                     "token_s": statistics.median(tokens[v]) if has_cache else None,
                     "tokens_s": tokens[v], "token_ratio": tr.get(v), "prefills_cpu_s": prefill_cpu[v],
                     "prefill_cpu_ratio": pr_cpu[v], "tokens_cpu_s": tokens_cpu[v], "token_cpu_ratio": tr_cpu.get(v),
                     "peak_bytes": m["peak_bytes"], "memory_ratio": m["peak_bytes"] / memory["prenorm"]["peak_bytes"],
                     "memory": m, "info": w.info, "profile": prof.get(v)})
    return {"rows": rows}


# ---------------------------------------------------------------------------------------------
# the table


def _x(r: float) -> str:
    return f"{r:.3f}x ({100 * (r - 1):+.1f} %)"


def _xc(r: dict, what: str) -> str:
    """The wall-time ratio, then the process CPU-time ratio."""
    return f"{_x(r[what + '_ratio'])}, CPU {r[what + '_cpu_ratio']:.3f}x"


def _sec(t: float) -> str:
    return f"{t:.2f} s" if t >= 1 else f"{1e3 * t:.1f} ms"


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**28 else f"{b / 2**20:.0f} MiB"


#: Rows of a profile table: each variant's first (largest) this many entries.
TOP_ROWS = 12


def _profile_numbers(p: dict) -> dict:
    """One profile as {row label: number}: torch's categories (ms), JAX's flops / bytes /
    instruction counts, MLX's primitive counts."""
    if "ms" in p:
        return p["ms"]
    if "flops" in p:
        return {"GFLOP": p["flops"] / 1e9, "GB accessed": p["bytes_accessed"] / 1e9,
                "HLO instructions": p["instructions"], **p["by_opcode"]}
    return {"primitives": p["primitives"], **p["by_primitive"]}


def _num(v) -> str:
    return f"{v:,}" if isinstance(v, int) else f"{v:,.2f}"


def _impls(r: dict) -> str:
    """The implementations that served the row's depth attention, with their call counts."""
    counts = (r["memory"].get("impl_counts_timed") or r["info"].get("impl_counts_warmup")
              or r["info"].get("impl_counts_traced") or {})
    fused = r["info"].get("fused_reads")
    fused = {"step": fused} if isinstance(fused, bool) else (fused or {})
    said = [f"{k} x{v}" for k, v in counts.items()] + [f"fused router reads ({k})" for k, f in fused.items() if f]
    return ", ".join(said) or "no dispatch record"


def _label(g: dict) -> str:
    """backend, path (what served each AttnRes variant's depth attention)."""
    served = {v: _impls(r) for v, r in g.items() if v != "prenorm"}
    said = (next(iter(served.values())) if len(set(served.values())) == 1
            else "; ".join(f"{v}: {i}" for v, i in served.items()))
    r = g.get("block") or g.get("block-direct")
    return f"{r['framework']}, {r['info']['path']} (depth attention: {said})"


def markdown(doc: dict) -> str:
    m = doc["meta"]
    head = [f"{m['date']}, {m['cpu']} ({m['cpus']} CPUs), load average {m['load_before']} before / "
            f"{m['load_after']} after. Command: `{m['command']}`."]
    lines = ["", "Train step (AdamW). Ratios to PreNorm are medians of per-round ratios: wall time, then "
             "the worker's process CPU time (less swayed by other jobs on a shared machine); peak memory "
             "per worker process. The paper: Block AttnRes < 4 % training overhead.", "",
             "| backend, path | L | B x T | PreNorm step | Full step | Block step | PreNorm peak | Full peak | "
             "Block peak | paper (Block) |", "|---|---|---|---|---|---|---|---|---|---|"]
    by = {}
    for r in doc["train"]:
        by.setdefault((r["framework"], r["form"], r["layers"]), {})[r["variant"]] = r
    for (fw, form, L), g in by.items():
        p = g["prenorm"]

        def step(v):
            return _xc(g[v], "step") if v in g else "— (not run)"

        def peak(v):
            return _x(g[v]["memory_ratio"]) if v in g else "—"

        lines.append(f"| {_label(g)} | {L} | {p['batch']} x {p['seq']} | {_sec(p['step_s'])} | "
                     f"{step('full')} | {step('block')} | {_gib(p['peak_bytes'])} | "
                     f"{peak('full')} | {peak('block')} | < 1.04x |")
    notes = []
    for (fw, form, L), g in by.items():
        if "saved_activation_bytes" in g["prenorm"]["memory"] and len(g) == len(TRAIN_VARIANTS):
            a = {v: g[v]["memory"]["saved_activation_bytes"] for v in TRAIN_VARIANTS}
            notes.append(f"{fw} L={L}, saved activations (`experiments.probes.training_memory`): PreNorm "
                         f"{_gib(a['prenorm'])}, Full {_x(a['full'] / a['prenorm'])}, Block "
                         f"{_x(a['block'] / a['prenorm'])}; 16 B/parameter state "
                         f"{_gib(g['prenorm']['memory']['state_bytes'])}.")
    for L in sorted({k[2] for k in by if k[0] == "jax"}):
        groups = {k[1]: g for k, g in by.items() if k[0] == "jax" and k[2] == L}
        if len(groups) > 1:
            said = []
            for v in TRAIN_VARIANTS:
                steps = {f: g[v]["step_s"] for f, g in groups.items() if v in g}
                said.append(f"{v} {min(steps, key=steps.get)} (" +
                            ", ".join(f"{f} {_sec(t)}" for f, t in steps.items()) + ")")
            notes.append(f"jax L={L}, the faster form per variant (medians from separate runs): " +
                         "; ".join(said) + ".")
    for (fw, form, L), g in by.items():
        if "block" in g and "full" in g and len(g["block"].get("alive", TRAIN_VARIANTS)) < len(TRAIN_VARIANTS):
            notes.append(f"{fw} L={L}: measured in pairs (`--train-pairs`): PreNorm + Full, then PreNorm + "
                         "Block, each ratio to its own pair's PreNorm.")
    lines += [""] + [f"- {n}" for n in notes] if notes else []
    lines = head + (lines if doc["train"] else [])
    decode = ["", "Decode, batch 1: prefill P tokens, then per-token latency with a KV cache. The paper: "
              "Block AttnRes < 2 % inference overhead.", "",
              "| backend, model, path | L | P | PreNorm prefill / token | Full | Block direct | "
              "Block two-phase | paper (Block) |", "|---|---|---|---|---|---|---|---|"]
    lines += decode if doc["decode"] else []
    by = {}
    for r in doc["decode"]:
        by.setdefault((r["framework"], r["form"], r["layers"]), {})[r["variant"]] = r
    for (fw, form, L), g in by.items():
        p = g["prenorm"]

        def cell(v):
            r = g.get(v)
            if r is None:
                return "— (scanned: direct only)"
            tok = _xc(r, "token") if r["kv_cache"] else "no KV cache"
            return f"prefill {_xc(r, 'prefill')}; token {tok}"

        base = (f"{_sec(p['prefill_s'])} / " +
                (_sec(p["token_s"]) if p["kv_cache"] else "— (no KV cache in this model)"))
        lines.append(f"| {_label(g)}, {g['block-direct']['info']['model']} | {L} | {p['prefill']} | {base} | "
                     f"{cell('full')} | {cell('block-direct')} | {cell('block-two_phase')} | < 1.02x |")
    if doc["skipped"] or doc["errors"]:
        lines += [""] + [f"- skipped: {n}" for n in doc["skipped"]]
        lines += [f"- failed: {e.splitlines()[0]}" for e in doc["errors"]]
    for task in ("train", "decode"):
        groups: dict = {}
        for r in doc[task]:
            if r.get("profile"):
                groups.setdefault((r["framework"], r["form"], r["layers"]), {})[r["variant"]] = r["profile"]
        for (fw, form, L), g in groups.items():
            flat = {v: _profile_numbers(p) for v, p in g.items()}
            keys = list(dict.fromkeys(k for f in flat.values() for k in list(f)[:TOP_ROWS]))
            method = next(iter(g.values()))["method"]
            lines += ["", f"Profile, {fw} {task}{'' if form == '-' else ' ' + form} L = {L}: {method}.", "",
                      "| | " + " | ".join(flat) + " |", "|---" * (len(flat) + 1) + "|"]
            lines += [f"| {k} | " + " | ".join(_num(f.get(k, 0)) for f in flat.values()) + " |" for k in keys]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------


def settings(args, framework: str, layers: int) -> dict:
    s = dict(dim=args.dim, layers=layers, heads=args.heads, vocab=args.vocab, batch=args.batch, seq=args.seq,
             prefill=args.prefill, tokens=args.tokens, steps=args.steps, warmup=args.warmup,
             prefill_reps=args.prefill_reps, threads=args.threads)
    if framework == "mlx":
        s.update(batch=args.mlx_batch, seq=args.mlx_seq, prefill=args.mlx_prefill)
    return s


def _forms(args, fw: str, task: str) -> list:
    """The forms a framework's task runs in: JAX's `--jax-forms`, torch decode's `--torch-decode`
    ("-" for eager, the form every earlier table has), else one ("-")."""
    if fw == "jax":
        return args.jax_forms
    if fw == "torch" and task == "decode":
        return ["-" if f == "eager" else f for f in args.torch_decode]
    return ["-"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    ap.add_argument("--tasks", nargs="+", default=["train", "decode"], choices=("train", "decode"))
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, nargs="+", default=[32], help="sublayers L (even)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32, help="timed decode tokens")
    ap.add_argument("--steps", type=int, default=4, help="timed train steps per variant")
    ap.add_argument("--warmup", type=int, default=1, help="train warm-up steps")
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--mlx-batch", type=int, default=1)
    ap.add_argument("--mlx-seq", type=int, default=32)
    ap.add_argument("--mlx-prefill", type=int, default=32)
    ap.add_argument("--train-variants", nargs="+", default=list(TRAIN_VARIANTS), choices=TRAIN_VARIANTS,
                    help="the train variants (default all three; PreNorm, the baseline, is always run)")
    ap.add_argument("--train-pairs", action="store_true",
                    help="train PreNorm + Full, then PreNorm + Block (two models alive, not three)")
    ap.add_argument("--jax-forms", nargs="+", default=None, choices=("scanned", "unrolled", "scanned-carry"),
                    help="default: scanned and unrolled (--quick: scanned; the unrolled Full compiles for minutes)")
    ap.add_argument("--torch-decode", nargs="+", default=["eager"], choices=("eager", "compiled"),
                    help="torch decode forms: eager (DynamicCache), compiled (StaticCache, torch.compile)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    ap.add_argument("--gap", type=float, default=0.1, help="seconds of sleep before each step / prefill")
    ap.add_argument("--token-gap", type=float, default=0.02, help="seconds of sleep before each token")
    ap.add_argument("--profile", default="auto", choices=("auto", "always", "never"))
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke of every code path")
    ap.add_argument("--json", type=Path, default=None)
    for fw in FRAMEWORKS:
        ap.add_argument(f"--{fw}-python", default=str(ROOT / ".nox" / f"tests-{fw}" / "bin" / "python"))
    args = ap.parse_args(argv)
    if args.worker:
        framework, task, variant, form, s = args.worker
        worker_main(SimpleNamespace(framework=framework, task=task, variant=variant, form=form, **json.loads(s)))
        return 0
    if args.quick:
        args.dim, args.layers, args.heads, args.batch, args.seq = 64, [16], 4, 2, 16
        args.prefill = args.mlx_prefill = 8
        args.mlx_batch, args.mlx_seq = 2, 16
        args.tokens, args.steps, args.prefill_reps, args.gap, args.token_gap = 3, 3, 2, 0.0, 0.0
        args.jax_forms = args.jax_forms or ["scanned"]
    args.jax_forms = args.jax_forms or ["scanned", "unrolled"]
    args.train_variants = [v for v in TRAIN_VARIANTS if v == "prenorm" or v in args.train_variants]
    if any(L % 2 or L < 2 for L in args.layers):
        raise SystemExit(f"--layers: expected even sublayer counts >= 2, got {args.layers}")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "host": platform.node(), "cpu": _bench_module("bench_user_loop").cpu_model(),
            "cpus": os.cpu_count(), "load_before": _loadavg(),
            "command": "python bench/bench_cost.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    _log(f"# {meta['date']}, {meta['cpu']}, load {meta['load_before']}")
    doc = {"meta": meta, "paper": PAPER, "block_size": BLOCK_SIZE, "settings": {}, "train": [], "decode": [],
           "skipped": [], "errors": []}

    def write():
        meta["load_after"] = _loadavg()
        doc["markdown"] = markdown(doc)
        if args.json:  # after every group: a later failure keeps what was measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=1))

    for fw in args.frameworks:
        python = getattr(args, f"{fw}_python")
        if not Path(python).exists():
            doc["skipped"].append(f"{fw}: no interpreter at {python}")
            _log(f"  {fw}: skipped (no {python})")
            continue
        for L in args.layers:
            s = settings(args, fw, L)
            doc["settings"][f"{fw}/L{L}"] = s
            for task in args.tasks:
                for form in _forms(args, fw, task):
                    before = _loadavg()
                    _log(f"{fw} {task} {form} L={L}: load {before}")
                    fn = measure_train if task == "train" else measure_decode
                    try:
                        rows = fn(python, fw, s, args, form)["rows"]
                    except RuntimeError as e:  # a worker failed (or ran out of memory): the others go on
                        doc["errors"].append(f"{fw} {task} {form} L={L}: {e}")
                        _log(f"  FAILED: {e}")
                        continue
                    for r in rows:
                        r["load_before"], r["load_after"] = before, _loadavg()
                    doc[task] += rows
                    write()
    write()
    print(doc["markdown"])
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
