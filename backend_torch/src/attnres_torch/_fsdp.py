"""FSDP2 on the own-model route: refuse `fully_shard(block)` at the first forward, naming the fix.

The own-model route (docs/usage.md, "Converting a real model") calls `block.attention` and
`block.mlp` through the router's stream and never `block.forward`.  FSDP2 unshards a module's
parameters in that module's forward hooks, so after `fully_shard(block)` the sublayers meet their
still-sharded DTensor parameters and torch fails deep inside them ("aten.mul.Tensor got mixed
torch.Tensor and DTensor").  `guard(router)`, called by `DepthRouter.stream` while a process group
is up, finds the FSDP2 modules of the router's model once and hooks their direct children: a child
called outside its FSDP2 module's forward while that module's parameters are sharded raises a
ValueError that names the recipe that works, `fully_shard([block.attention, block.mlp])`.

Cost: a non-distributed pass pays `torch.distributed.is_initialized()` per stream, nothing else; a
distributed one a length check per stream and, on the FSDP2 modules' children, one hook each."""

from __future__ import annotations

import weakref

import torch
from torch import nn

_AVAILABLE = torch.distributed.is_available()
_SEEN: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()  # router -> count
_GUARDED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # FSDP2 modules already hooked


def active() -> bool:
    """True while a process group is up (outside a torch.compile trace): the only per-stream test a
    non-distributed pass pays."""
    return _AVAILABLE and torch.distributed.is_initialized() and not torch.compiler.is_compiling()


def _states():
    try:  # FSDP2's registry of composable states (torch >= 2.0); without it, nothing to guard
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return None, None
    return _module_state_mapping, FSDPModule


def guard(router: nn.Module) -> None:
    """Hook the FSDP2 modules of `router`'s model (the outermost FSDP2 module holding the router;
    all FSDP2 modules in the process when none holds it) once; re-scans only when the number of
    modules with a composable state changed."""
    mapping, fsdp_module = _states()
    if mapping is None:
        return
    count = len(mapping)
    if _SEEN.get(router) == count:
        return
    _SEEN[router] = count
    modules = [m for m in list(mapping.keys()) if isinstance(m, fsdp_module)]
    holders = [m for m in modules if any(x is router for x in m.modules())]
    if holders:  # the model: the holder with the largest tree
        root = max(holders, key=lambda m: sum(1 for _ in m.modules()))
        names = {id(m): name for name, m in root.named_modules()}
        modules = [m for m in root.modules() if isinstance(m, fsdp_module)]
    else:
        names = {}
    for module in modules:
        if not any(x is router for x in module.modules()):  # a holder's forward runs the stream
            _hook(module, names.get(id(module)), fsdp_module)


def _hook(module: nn.Module, name, fsdp_module) -> None:
    if module in _GUARDED:
        return
    _GUARDED.add(module)
    depth = [0]  # > 0 while the FSDP2 module's forward runs (its own hooks unshard then)

    def enter(mod, args):
        if not torch.compiler.is_compiling():  # (the check skips a traced call alike)
            depth[0] += 1

    def leave(mod, args, out):
        if not torch.compiler.is_compiling():
            depth[0] -= 1

    module.register_forward_pre_hook(enter, prepend=True)
    module.register_forward_hook(leave, always_call=True)
    for child_name, child in module.named_children():
        if isinstance(child, fsdp_module):
            continue  # its own group, its own hooks
        probe = _probe(child, fsdp_module)
        if probe is not None:
            child.register_forward_pre_hook(_check(depth, probe, module, name, child_name))


def _probe(child: nn.Module, fsdp_module):
    """(owner, parameter name) of one parameter under `child` that its FSDP2 module manages (not
    inside a nested FSDP2 module), or None."""
    stack = [child]
    while stack:
        m = stack.pop()
        for pname in m._parameters:
            if m._parameters[pname] is not None:
                return m, pname
        stack.extend(c for c in m.children() if not isinstance(c, fsdp_module))
    return None


def _check(depth, probe, module, name, child_name):
    from torch.distributed.tensor import DTensor

    owner, pname = probe

    def check(mod, args):
        if depth[0] or torch.compiler.is_compiling():
            return
        if isinstance(owner._parameters.get(pname), DTensor):
            raise ValueError(_message(module, name, child_name))

    return check


def _message(module: nn.Module, name, child_name: str) -> str:
    cls = next((c.__name__ for c in type(module).__mro__[1:]
                if issubclass(c, nn.Module) and not c.__name__.startswith("FSDP")), "Module")
    where = f"{name}.{child_name}" if name else f"{cls}.{child_name}"
    block = f"'{name}'" if name else "the block"
    return (f"FSDP2: {where} ran outside the forward of its FSDP2 module {block} ({cls}), whose "
            f"parameters are still sharded: fully_shard(block) unshards them in block.forward, "
            f"which the router's stream never calls (it calls the sublayers). Shard what the "
            f"stream calls instead, both sublayers of a block as one group: "
            f"fully_shard([block.attention, block.mlp]) for each block, then fully_shard(model) "
            f"(docs/usage.md, 'FSDP2 per layer')")
