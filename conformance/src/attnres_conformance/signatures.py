"""The public API that every backend shares, checked against one file: `signatures.json`.

A user moving between `attnres_torch`, `attnres_jax` and `attnres_mlx` (or checking one against
the reference `attnres_numpy`) should be able to reuse a call unchanged: the same name takes the
same parameters, in the same order, of the same kind (positional or keyword-only), with the same
defaults.  `signatures.json` (package data beside this module) holds:

* `signatures`: for every name shared by two or more backends, its canonical signature (a Python
  parameter list without annotations, e.g. `"(x, eps)"`; for a class, one per method:
  `__init__`, `__call__` (torch modules: `forward`), `stream`) and the backends that export it;
  `{"same_as": "module.Name"}` where every backend must re-export that very object;
* `backend_only`: per backend, each public name that exists in that backend alone, with why;
* `extras`: THE allowlist of framework-specific parameters, per backend, name and method, each
  with its reason (JAX's `impl=`, MLX's `inv_rms=` ...).  Extras are removed before the
  comparison; one must still exist (a stale entry is reported), and a positional extra must come
  after every canonical positional parameter (so positional calls of the canonical signature
  bind the same way);
* `missing`: per backend, `Name.method` entries a backend does not offer, with why;
* `dispatch`: the public backend contract of each framework backend's `<package>.dispatch`
  module (`attnres_core.dispatch`): its functions' signatures, `Choice` re-exported from the
  core, `IMPLEMENTATIONS` per backend, the keys of `capabilities()`; `availability()` must name
  every implementation, each with None or a reason (`dispatch_mismatches`, part of `mismatches`).

Annotations are not compared (each framework names its own array type); defaults are compared by
`repr`.  A backend's public names are its package's `__all__` plus the public functions and
classes defined in the submodules of `SURFACES` (JAX's Flax modules, MLX's probe network); every
one must be in `signatures` or `backend_only`.  The reference (`numpy`) is held only to the
shared names it has: its other public names (the VJPs, the golden-vector tools) are its own.

Each backend's test session checks its own surface (`mismatches("torch") == []`), so no
environment needs all frameworks; `python -m attnres_conformance.signatures torch` prints the
mismatches of the installed backend, `--dump` its current surface.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

#: The modules whose public names make up each backend's API (the first one is the package).
SURFACES = {
    "numpy": ("attnres_numpy",),
    "torch": ("attnres_torch",),
    "jax": ("attnres_jax", "attnres_jax.modules"),
    "mlx": ("attnres_mlx", "attnres_mlx.probe"),
}

PATH = Path(__file__).with_name("signatures.json")

#: (name, kind, repr of the default or None when it has none)
Param = Tuple[str, str, Optional[str]]

_KIND = {
    inspect.Parameter.POSITIONAL_ONLY: "positional-only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional or keyword",
    inspect.Parameter.VAR_POSITIONAL: "variadic positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword-only",
    inspect.Parameter.VAR_KEYWORD: "variadic keyword",
}
_POSITIONAL = ("positional-only", "positional or keyword")


@lru_cache(maxsize=None)
def load(path: str = str(PATH)) -> dict:
    """The checked-in table (`signatures.json`)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def parse(text: str) -> List[Param]:
    """A canonical parameter list such as `"(x, *, eps=1e-06)"` -> [(name, kind, default)]."""
    try:
        args = ast.parse(f"def _f{text}: pass").body[0].args
    except SyntaxError as e:
        raise ValueError(f"signatures.json: {text!r} is not a Python parameter list ({e.msg})") from None
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out: List[Param] = []
    for i, (a, d) in enumerate(zip(positional, defaults)):
        kind = "positional-only" if i < len(args.posonlyargs) else "positional or keyword"
        out.append((a.arg, kind, None if d is None else repr(ast.literal_eval(d))))
    if args.vararg is not None:
        out.append((args.vararg.arg, "variadic positional", None))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append((a.arg, "keyword-only", None if d is None else repr(ast.literal_eval(d))))
    if args.kwarg is not None:
        out.append((args.kwarg.arg, "variadic keyword", None))
    return out


def describe(fn, *, drop_self: bool = False) -> List[Param]:
    """The live signature of `fn` as [(name, kind, repr(default) or None)]."""
    params = list(inspect.signature(fn).parameters.values())
    if drop_self:
        params = params[1:]
    return [(p.name, _KIND[p.kind], None if p.default is inspect.Parameter.empty else repr(p.default))
            for p in params]


def render(params: Sequence[Param]) -> str:
    """[(name, kind, default)] -> `"(a, b=1, *, c=2)"` (the notation of signatures.json)."""
    parts: List[str] = []
    star = False
    for i, (name, kind, default) in enumerate(params):
        if kind == "keyword-only" and not star:
            parts.append("*")
            star = True
        elif kind == "variadic positional":
            star = True
        prefix = {"variadic positional": "*", "variadic keyword": "**"}.get(kind, "")
        parts.append(prefix + name + ("" if default is None else f"={default}"))
        if kind == "positional-only" and (i + 1 == len(params) or params[i + 1][1] != "positional-only"):
            parts.append("/")
    return "(" + ", ".join(parts) + ")"


def method(cls, name: str):
    """The method `name` of `cls` as called by users: a torch `nn.Module`'s `__call__` is its
    `forward`; None when the class has no such method."""
    if name == "__call__" and callable(getattr(cls, "forward", None)):
        return cls.forward
    fn = getattr(cls, name, None)
    return fn if callable(fn) else None


def public(module) -> Dict[str, object]:
    """name -> object: `__all__` where the module has one, else the public functions and classes
    the module defines itself (not what it imports)."""
    if hasattr(module, "__all__"):
        return {n: getattr(module, n) for n in module.__all__
                if inspect.isfunction(getattr(module, n)) or inspect.isclass(getattr(module, n))}
    return {n: v for n, v in vars(module).items()
            if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
            and getattr(v, "__module__", None) == module.__name__}


def surface(backend: str, modules: Optional[Sequence] = None) -> Dict[str, object]:
    """A backend's public names -> objects (over its SURFACES modules, imported by name, or the
    module objects given)."""
    if backend not in SURFACES:
        raise ValueError(f"backend: expected one of {', '.join(SURFACES)}, got {backend!r}")
    if modules is None:
        modules = [importlib.import_module(m) for m in SURFACES[backend]]
    names: Dict[str, object] = {}
    for module in modules:
        for name, obj in public(module).items():
            if name in names and names[name] is not obj:
                raise ValueError(f"{backend}: {name!r} is public in two of its modules as different objects")
            names[name] = obj
    return names


def _compare(where: str, live: List[Param], canonical: List[Param], extras: Mapping[str, str]) -> List[str]:
    problems = [f"{where}: allowlisted extra {e!r} is not a parameter any more (remove it from "
                f"signatures.json)" for e in extras if e not in {p[0] for p in live}]
    last_positional = max((i for i, p in enumerate(live) if p[0] not in extras and p[1] in _POSITIONAL),
                          default=-1)
    for i, p in enumerate(live):
        if p[0] in extras and p[1] in _POSITIONAL and i < last_positional:
            problems.append(f"{where}: extra {p[0]!r} is positional before a shared positional "
                            f"parameter, so positional calls bind differently than elsewhere")
    got = [p for p in live if p[0] not in extras]
    if got != canonical:
        details = []
        names_got, names_want = [p[0] for p in got], [p[0] for p in canonical]
        if set(names_got) - set(names_want):
            details.append(f"unexpected {sorted(set(names_got) - set(names_want))}")
        if set(names_want) - set(names_got):
            details.append(f"missing {sorted(set(names_want) - set(names_got))}")
        if not details and names_got != names_want:
            details.append("different order")
        wanted = dict((p[0], p) for p in canonical)
        for p in got:
            w = wanted.get(p[0])
            if w is not None and w[1] != p[1]:
                details.append(f"{p[0]!r} is {p[1]}, expected {w[1]}")
            if w is not None and w[2] != p[2]:
                details.append(f"{p[0]!r} defaults to {p[2] or 'nothing'}, expected {w[2] or 'nothing'}")
        problems.append(f"{where}: signature {render(got)} (extras removed: {sorted(extras)}), expected "
                        f"{render(canonical)}: {'; '.join(details)}")
    return problems


def mismatches(backend: str, modules: Optional[Sequence] = None, table: Optional[dict] = None) -> List[str]:
    """Every way `backend`'s public API departs from signatures.json (empty: it agrees).

    modules: the module objects to read (default: import SURFACES[backend]); table: the parsed
    signatures file (default: the packaged one)."""
    table = load() if table is None else table
    names = surface(backend, modules)
    extras = table.get("extras", {}).get(backend, {})
    missing = table.get("missing", {}).get(backend, {})
    own = table.get("backend_only", {}).get(backend, {})
    problems: List[str] = []
    used_extras, used_missing = set(), set()
    for name, entry in table["signatures"].items():
        present = name in names
        expected = backend in entry["backends"]
        if present and not expected and backend != "numpy":
            problems.append(f"{backend}.{name}: exported but signatures.json does not list "
                            f"{backend!r} among its backends")
        if not expected:
            continue
        if not present:
            problems.append(f"{backend}.{name}: listed in signatures.json but not exported")
            continue
        obj = names[name]
        if "same_as" in entry:
            mod, _, attr = entry["same_as"].rpartition(".")
            if obj is not getattr(importlib.import_module(mod), attr):
                problems.append(f"{backend}.{name}: must be {entry['same_as']} itself (a re-export)")
            continue
        if "signature" in entry:
            used_extras.add(name)
            problems += _compare(f"{backend}.{name}", describe(obj), parse(entry["signature"]),
                                 extras.get(name, {}))
            continue
        if not inspect.isclass(obj):
            problems.append(f"{backend}.{name}: expected a class, got {type(obj).__name__}")
            continue
        for meth, text in entry["methods"].items():
            key = f"{name}.{meth}"
            fn = method(obj, meth)
            if fn is None:
                if key in missing:
                    used_missing.add(key)
                else:
                    problems.append(f"{backend}.{key}: missing (or allowlist it under 'missing')")
                continue
            if key in missing:
                used_missing.add(key)
                problems.append(f"{backend}.{key}: exists now: remove it from 'missing' in signatures.json")
            used_extras.add(key)
            problems += _compare(f"{backend}.{key}", describe(fn, drop_self=True), parse(text),
                                 extras.get(key, {}))
    problems += [f"{backend}: 'extras' entry {k!r} names no shared signature" for k in extras
                 if k not in used_extras]
    problems += [f"{backend}: 'missing' entry {k!r} names no shared method" for k in missing
                 if k not in used_missing]
    problems += dispatch_mismatches(backend, table=table)
    if backend != "numpy":
        problems += [f"{backend}.{n}: public, but neither a shared name in signatures.json nor in "
                     f"its backend_only list" for n in sorted(names)
                     if n not in table["signatures"] and n not in own]
        problems += [f"{backend}.{n}: listed as backend_only but not exported" for n in own if n not in names]
        problems += [f"{backend}.{n}: listed as backend_only, but also a shared name" for n in own
                     if n in table["signatures"]]
    return problems



def dispatch_mismatches(backend: str, module=None, table: Optional[dict] = None) -> List[str]:
    """Every way `backend`'s dispatch module departs from the contract in signatures.json's
    `dispatch` entry (empty: it agrees; a backend the entry does not list has no contract).

    module: the dispatch module object (default: import `<package>.dispatch`)."""
    table = load() if table is None else table
    contract = table.get("dispatch")
    if contract is None or backend not in contract["backends"]:
        return []
    name = f"{SURFACES[backend][0]}.dispatch"
    module = importlib.import_module(name) if module is None else module
    problems: List[str] = []
    for fn_name, text in contract["signatures"].items():
        fn = getattr(module, fn_name, None)
        if not callable(fn):
            problems.append(f"{name}.{fn_name}: missing (the backend contract)")
            continue
        problems += _compare(f"{name}.{fn_name}", describe(fn), parse(text), {})
    for attr, target in contract["same_as"].items():
        mod, _, obj = target.rpartition(".")
        if getattr(module, attr, None) is not getattr(importlib.import_module(mod), obj):
            problems.append(f"{name}.{attr}: must be {target} itself (a re-export)")
    want = tuple(contract["implementations"][backend])
    got = getattr(module, "IMPLEMENTATIONS", None)
    if tuple(got or ()) != want or not isinstance(got, tuple):
        problems.append(f"{name}.IMPLEMENTATIONS: {got!r}, expected the tuple {want!r}")
    if callable(getattr(module, "availability", None)):
        avail = module.availability()
        if not isinstance(avail, dict) or tuple(avail) != want:
            problems.append(f"{name}.availability(): keys {list(avail) if isinstance(avail, dict) else avail!r}, "
                            f"expected every implementation in order {list(want)}")
        else:
            problems += [f"{name}.availability()[{k!r}]: {v!r}, expected None or a non-empty reason"
                         for k, v in avail.items() if not (v is None or (isinstance(v, str) and v))]
    if callable(getattr(module, "capabilities", None)):
        caps = module.capabilities()
        keys = sorted(caps) if isinstance(caps, dict) else caps
        if keys != sorted(contract["capabilities"]):
            problems.append(f"{name}.capabilities(): keys {keys!r}, expected {sorted(contract['capabilities'])}")
    return problems


def renamed(fn, old: str, new: str):
    """`fn` with its parameter `old` renamed to `new` (only the signature changes): the defect the
    checker's own tests inject to see it fail."""
    s = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    wrapper.__signature__ = s.replace(parameters=[p.replace(name=new) if p.name == old else p
                                                  for p in s.parameters.values()])
    return wrapper


def dump(backend: str) -> Dict[str, str]:
    """The installed backend's surface in the notation of signatures.json (to update the file)."""
    out: Dict[str, str] = {}
    for name, obj in sorted(surface(backend).items()):
        if inspect.isclass(obj):
            for meth in ("__init__", "__call__", "stream"):
                fn = method(obj, meth)
                if fn is not None and (meth != "__init__" or "__init__" in vars(obj)):
                    try:
                        out[f"{name}.{meth}"] = render(describe(fn, drop_self=True))
                    except (TypeError, ValueError):
                        pass
        else:
            out[name] = render(describe(obj))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    as_dump = "--dump" in args
    backends = [a for a in args if a != "--dump"] or ["numpy"]
    status = 0
    for backend in backends:
        if as_dump:
            print(json.dumps({backend: dump(backend)}, indent=2))
            continue
        problems = mismatches(backend)
        print(f"{backend}: {len(problems)} mismatch(es) with {PATH.name}")
        for p in problems:
            print("  " + p)
        status |= bool(problems)
    return status


if __name__ == "__main__":
    sys.exit(main())
