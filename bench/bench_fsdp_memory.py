"""Saved bytes of a converted Hugging Face Llama trained under FSDP2 (`fully_shard` per decoder
layer, then the root), per rank, for the memory modes: plain, `Recompute`, HF's own
`activation_checkpointing_enable()` and `Offload` (issue 28 item 4).

Two gloo ranks on the CPU (`attnres_torch.distributed.launch.run_local`); each rank trains one
step on its half of the batch.  Per rank: the bytes autograd keeps for the backward
(`SavedBytes`: distinct storages, parameters excluded; Offload: its peak held on the device),
divided by the rank's tokens, and the step time.  PreNorm rows are the unconverted model.

Usage: python bench/bench_fsdp_memory.py [--depth 16] [--dim 256] [--batch 4] [--context 128]
       [--block-size 4]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time

MODES = ("plain", "recompute", "hf-ckpt", "offload")
KINDS = ("standard", "full", "block")


def _rank(rank, world, args, kind, mode):
    import torch
    from attnres_core.config import ResidualConfig
    from attnres_torch import hf
    from attnres_torch.memory import Offload, Recompute, SavedBytes
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=args.dim, intermediate_size=4 * args.dim,
                         num_hidden_layers=args.depth // 2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=args.context)
    model = LlamaForCausalLM(config).train()
    subs = model.model.layers
    if kind != "standard":
        cfg = ResidualConfig(kind="full") if kind == "full" else ResidualConfig(kind="block", block_size=args.block_size)
        hf.convert(model, cfg)
        subs = model
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if mode == "hf-ckpt":
        model.activation_checkpointing_enable()
    tokens = torch.randint(0, 256, (args.batch // world, args.context),
                           generator=torch.Generator().manual_seed(rank))
    off = None

    def step():
        nonlocal off
        model.zero_grad()
        acct = SavedBytes()
        ctx = (Recompute(subs) if mode == "recompute" else
               Offload(subs, window=2) if mode == "offload" else contextlib.nullcontext())
        with acct, ctx as c:
            loss = model(tokens, labels=tokens, use_cache=False).loss
        off = c if mode == "offload" else None
        loss.backward()
        return acct

    step()
    t0 = time.perf_counter()
    acct = step()
    dt = time.perf_counter() - t0
    saved = off.peak_device_bytes if off is not None else acct.bytes
    return saved / tokens.numel(), dt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depth", type=int, default=16, help="L sublayers (2 per decoder layer)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--block-size", type=int, default=4)
    args = p.parse_args(argv)
    from attnres_torch.distributed.launch import run_local

    load = os.getloadavg()[0]
    rows = []
    for kind in KINDS:
        for mode in MODES:
            res = run_local(_rank, 2, args, kind, mode, timeout=600)
            saved = max(r[0] for r in res)
            dt = max(r[1] for r in res)
            rows.append((kind, mode, saved, dt))
            print(f"{kind:8s} {mode:9s} saved {saved / 1024:.1f} KiB/tok per rank, {dt:.2f} s/step",
                  file=sys.stderr, flush=True)
    print(f"### FSDP2 per decoder layer, 2 gloo ranks, CPU (`bench/bench_fsdp_memory.py`)\n\n"
          f"{platform.machine()} {os.cpu_count()}-core, {time.strftime('%Y-%m-%d %H:%M')}, load "
          f"{load:.1f} before, {os.getloadavg()[0]:.1f} after; transformers Llama, d = {args.dim}, "
          f"L = {args.depth} sublayers, {args.batch // 2} x {args.context} tokens per rank, fp32, "
          f"Block S = {args.block_size}.\n\n"
          "| scheme | mode | saved KiB/tok per rank | x plain | s/step |\n|---|---|---:|---:|---:|")
    for kind, mode, saved, dt in rows:
        base = next(r[2] for r in rows if r[0] == kind and r[1] == "plain")
        print(f"| {kind} | {mode} | {saved / 1024:.1f} | {base / saved:.2f} | {dt:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
