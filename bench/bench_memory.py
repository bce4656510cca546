"""Activation memory and step time of the memory modes (`attnres_torch.memory`), issue 15 part 1.

For standard (PreNorm), Full and Block AttnRes and Full AttnRes with the fused output norm (M15,
"fused") `AttnResTransformer`s at two depths (L = 16 and 64 sublayers by default), each under the
plain path, `Recompute` and `Offload(window=W)` and, for the AttnRes schemes, each `--saves`
value of the router's `save` (what the depth-attention backward keeps: "out" or "stats", the
lse alone), one fresh subprocess per case measures a training step (forward + backward of the
summed logits, fp32):

* saved bytes: what the forward leaves for the backward, as distinct storages (parameters
  excluded): `SavedBytes` for plain and Recompute (plus the inputs Recompute's checkpoints
  keep), `Offload.peak_device_bytes` for Offload (the most bytes held on the compute device at a
  sublayer boundary, including sources the forward still holds);
* peak memory of the step beyond what was allocated before it: on CUDA
  `torch.cuda.max_memory_allocated()`; on the CPU the process's peak RSS (VmHWM, reset with
  `/proc/self/clear_refs` after a warm-up step that allocated the gradients; glibc's mmap
  threshold fixed at 64 KiB so freed tensors leave the RSS), which includes temporaries and the
  backward's working set;
* the step time: median of `--reps` steps after the warm-up.

`--model hf-llama` runs the same rows on a Hugging Face `LlamaForCausalLM` (transformers,
random weights; d = --dim, L / 2 decoder layers) converted with `attnres_torch.hf` (standard:
the unconverted model), with one more mode: HF's own `gradient_checkpointing_enable()`.

Every number is divided by the tokens per step (batch x context); ratios are against the plain
path of the same scheme and depth.  On a CPU the host is the device, so Offload's RSS cannot
drop: its saved-bytes column is what would leave a GPU.

Usage: python bench/bench_memory.py [--model attnres|hf-llama] [--device cpu|cuda] [--depths 16,64] [--dim 256]
       [--batch 4] [--context 128] [--block-size 4] [--window 2] [--reps 3] [--threads 1]
       [--kinds standard,full,block,fused] [--saves out,stats] [--out bench/results/memory.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

KINDS = ("standard", "full", "block", "fused")
#: The router's `save` values compared (standard has no depth attention: one row, save "-").
SAVES = ("out", "stats")


def _config(args):
    from attnres_core.config import ResidualConfig

    if args.kind == "block":
        return ResidualConfig.variant("block", block_size=args.block_size)
    return ResidualConfig.variant("fused_out_norm" if args.kind == "fused" else args.kind)


MODES = ("plain", "recompute", "offload")
HF_MODES = MODES + ("hf-ckpt",)


def _hf_llama(args, cfg):
    """A `LlamaForCausalLM` with L / 2 decoder layers (random weights), converted to `cfg`
    (the kind "standard": left as the PreNorm model it is); returns (model, sublayer modules)."""
    from attnres_torch import hf
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=args.dim, intermediate_size=4 * args.dim,
                         num_hidden_layers=args.depth // 2, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.context)
    model = LlamaForCausalLM(config)
    if cfg.kind == "standard":
        return model, model.model.layers  # Recompute / Offload over the decoder layers
    hf.convert(model, cfg)
    return model, model


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(args) -> dict:
    import torch
    from attnres_torch import hf
    from attnres_torch.memory import Offload, Recompute, SavedBytes
    from attnres_torch.modules import AttnResTransformer

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    L = args.depth
    cfg = _config(args)
    torch.manual_seed(0)
    if args.model == "hf-llama":
        model, subs = _hf_llama(args, cfg)
        model = model.to(dev).train()
        if args.mode == "hf-ckpt":
            model.gradient_checkpointing_enable()
        forward = lambda: model(tokens, use_cache=False).logits  # noqa: E731
    else:
        model = AttnResTransformer(256, args.dim, L // 2, args.heads, cfg).to(dev)
        subs = model
        forward = lambda: model(tokens)  # noqa: E731
    if args.kind != "standard":
        (model.router if args.model == "attnres" else hf.router(model)).save = args.save
    tokens = torch.randint(0, 256, (args.batch, args.context), device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step(acct=None):
        model.zero_grad(set_to_none=False)
        off = None
        if args.mode in ("plain", "hf-ckpt"):
            with acct or SavedBytes():
                loss = forward().sum()
        elif args.mode == "recompute":
            with acct or SavedBytes(), Recompute(subs):
                loss = forward().sum()
        else:
            with Offload(subs, window=args.window) as off:
                loss = forward().sum()
        loss.backward()
        del loss
        return off

    step()  # warm-up: kernel loading, gradient buffers
    sync()
    import gc
    gc.collect()
    acct = SavedBytes()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        off = step(acct)
        sync()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        before = _status("VmRSS")
        off = step(acct)
        peak = _status("VmHWM") - before
    saved = off.peak_device_bytes if off is not None else acct.bytes
    times = []
    for _ in range(args.reps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    tokens_n = args.batch * args.context
    return {"kind": args.kind, "mode": args.mode, "depth": L,
            "save": args.save if args.kind != "standard" else "-", "saved_per_token": saved / tokens_n,
            "offloaded_per_token": (off.offloaded_bytes / tokens_n) if off is not None else 0.0,
            "peak_per_token": peak / tokens_n, "step_s": statistics.median(times)}


def _fmt_kib(x: float) -> str:
    return f"{x / 1024:.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--depths", default="16,64", help="comma list of L (sublayers, even)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (0: default)")
    p.add_argument("--model", default="attnres", choices=("attnres", "hf-llama"),
                   help="attnres: AttnResTransformer; hf-llama: a converted transformers Llama")
    p.add_argument("--kinds", default=None, help="comma list of " + ", ".join(KINDS) + " (default: "
                   "all; hf-llama: all but fused, which a converted model refuses)")
    p.add_argument("--saves", default=",".join(SAVES), help="comma list of the router's save values")
    p.add_argument("--out", type=Path, default=None, help="default bench/results/memory[-hf-llama].md")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", default="full", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
    p.add_argument("--depth", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--save", default="auto", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.out is None:
        suffix = "" if args.model == "attnres" else f"-{args.model}"
        args.out = Path(f"bench/results/memory{suffix}.md")
    depths = [int(d) for d in args.depths.split(",")]
    kinds = (args.kinds.split(",") if args.kinds else
             [k for k in KINDS if not (args.model == "hf-llama" and k == "fused")])
    saves = args.saves.split(",")
    if not set(kinds) <= set(KINDS) or not set(saves) <= {"auto", "out", "stats"}:
        raise SystemExit(f"--kinds / --saves: expected values of {KINDS} / auto, out, stats")
    if any(d < 2 or d % 2 for d in depths):
        raise SystemExit(f"--depths: expected even ints >= 2, got {args.depths!r}")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device")
    rows = []
    started = time.strftime("%Y-%m-%d %H:%M")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    common = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in
              ("device", "dim", "heads", "batch", "context", "block-size", "window", "reps", "threads",
               "model")]
    # a fixed glibc mmap threshold: freed tensors go back to the OS, so the peak RSS of the
    # measured step is not hidden by heap pages kept from the warm-up step
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    for depth in depths:
        for kind, save, mode in [(k, s, m) for k in kinds for s in (saves[:1] if k == "standard" else saves)
                                 for m in (HF_MODES if args.model == "hf-llama" else MODES)]:
                cmd = [sys.executable, __file__, "--child", f"--kind={kind}", f"--mode={mode}",
                       f"--depth={depth}", f"--save={save}", *common]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if out.returncode:
                    raise SystemExit(f"{kind}/{save}/{mode}/L={depth} failed:\n{out.stderr[-3000:]}")
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                r = rows[-1]
                print(f"L={depth} {kind:8s} {r['save']:5s} {mode:9s} saved {_fmt_kib(r['saved_per_token'])} KiB/tok, "
                      f"peak {_fmt_kib(r['peak_per_token'])} KiB/tok, {r['step_s']:.3f} s/step",
                      file=sys.stderr, flush=True)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    import torch
    lines = [
        f"### Memory modes, {args.device.upper()} (`bench/bench_memory.py`)", "",
        f"Machine: {platform.machine()} {os.cpu_count()}-core {platform.system()}, "
        f"{'GPU ' + torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}, torch {torch.__version__}, "
        f"{args.threads or 'default'} thread(s); date {started}; load average {load:.1f} before, "
        f"{load_after:.1f} after.",
        ("Model: `AttnResTransformer`" if args.model == "attnres" else
         "Model: transformers `LlamaForCausalLM` converted by `attnres_torch.hf` (standard: unconverted; "
         "hf-ckpt: HF's gradient_checkpointing_enable())")
        + f", d = {args.dim}, {args.heads} heads, MLP 4d, vocab 256, fp32; "
        f"batch {args.batch} x context {args.context} = {args.batch * args.context} tokens per step; "
        f"Block S = {args.block_size}; Offload window W = {args.window}.  One fresh process per "
        f"row; step = forward + backward; median of {args.reps} steps after a warm-up.",
        "",
        "saved = bytes autograd keeps for the backward (distinct storages, parameters excluded; "
        "Offload: the most held on the device at a sublayer boundary); peak = "
        + ("`max_memory_allocated` growth over the step" if args.device == "cuda" else
           "peak RSS growth over the step (VmHWM, includes temporaries and allocator slack)")
        + "; KiB per token; x = that column's ratio plain / mode (higher = less memory); save = the "
        "router's `save` (out: the depth attention's backward keeps its output; stats: only lse).", "",
        "| L | scheme | save | mode | saved KiB/tok | saved x | peak KiB/tok | peak x | offloaded KiB/tok | s/step | time x |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = next(b for b in rows if b["depth"] == r["depth"] and b["kind"] == r["kind"]
                    and b["save"] == r["save"] and b["mode"] == "plain")
        ratio = lambda k: base[k] / r[k] if r[k] > 0 else float("nan")  # noqa: E731
        lines.append(
            f"| {r['depth']} | {r['kind']} | {r['save']} | {r['mode']} | {_fmt_kib(r['saved_per_token'])} | "
            f"{ratio('saved_per_token'):.2f} | {_fmt_kib(r['peak_per_token'])} | {ratio('peak_per_token'):.2f} | "
            f"{_fmt_kib(r['offloaded_per_token'])} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} |")
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    (args.out.with_suffix(".json")).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
