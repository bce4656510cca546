"""Combinations by covering arrays, not a full product (issue 44, item 2).

`pairwise(params, allowed)` is a deterministic greedy (AETG-style) covering array: every pair of
values of every two parameters that `allowed` admits appears in at least one row.  `PARAMS` are
the options of each op (heads, activation, key norm, query form, gain, lse, layout, eps, scale,
the fused output norm and its own eps, dtype); `covering_cases` makes one case per row, in the
row `covering/<op>`, so an option pair no hand-written row combines (the fused norm at a key-norm
eps other than 1e-6, a scale of 0 with heads, sigmoid with a negative scale, ...) is still met.
"""

from __future__ import annotations

from itertools import combinations
from typing import Callable, Dict, List, Sequence, Tuple

from .numerics import DTYPES

Params = Sequence[Tuple[str, Sequence]]

#: Each op's parameters (name, values), constraints first in the order (a value is chosen
#: knowing the earlier ones).
PARAMS: Dict[str, Params] = {
    "depth_attention": (("dtype", DTYPES), ("activation", ("softmax", "sigmoid")), ("num_heads", (1, 2)),
                        ("key_norm", (True, False)), ("token_query", (False, True)), ("gain", (True, False)),
                        ("lse", (False, True)), ("layout", ("list", "stacked", "tuple")),
                        ("eps", (1e-6, 1e-2)), ("scale", (1.0, 0.37, -1.5, 0.0)),
                        # the fused output norm: off, at the key norm's eps (no out_norm_eps), at its own
                        ("out_norm", ("off", "eps", 1e-3))),
    "depth_attention_multi": (("dtype", DTYPES), ("gain", (True, False)), ("layout", ("list", "stacked")),
                              ("eps", (1e-6, 1e-2)), ("scale", (1.0, 0.37, -1.5, 0.0))),
    "merge_partial": (("dtype", DTYPES), ("token_query", (False, True)), ("gain", (True, False)),
                      ("lse", (False, True)), ("eps", (1e-6, 1e-2)), ("scale", (1.0, 0.37, -1.5, 0.0))),
}


def allowed(row: dict) -> bool:
    """The spec's constraints on a partial row: lse needs softmax (C9)."""
    if row.get("lse") and row.get("activation") == "sigmoid":
        return False
    return True


def pairwise(params: Params, ok: Callable[[dict], bool] = allowed) -> List[dict]:
    """Rows covering every allowed pair of values of every two parameters (greedy, deterministic)."""
    names = [n for n, _ in params]
    values = dict(params)
    todo = {((a, va), (b, vb)) for a, b in combinations(names, 2) for va in values[a] for vb in values[b]
            if ok({a: va, b: vb})}
    rows: List[dict] = []
    while todo:
        (a, va), (b, vb) = min(todo, key=repr)  # each row starts from an open pair
        row: dict = {a: va, b: vb}
        for name in names:
            if name in row:
                continue
            best, gain = None, -1
            for v in values[name]:
                trial = dict(row, **{name: v})
                if not ok(trial):
                    continue
                new = sum(1 for pair in todo if _covers(trial, pair) and (name, v) in pair)
                if new > gain:
                    best, gain = v, new
            row[name] = best
        row = {n: row[n] for n in names}
        covered = {pair for pair in todo if _covers(row, pair)}
        if not covered:  # cannot happen with consistent constraints; never loop forever
            break
        todo -= covered
        rows.append(row)
    return rows


def _covers(row: dict, pair) -> bool:
    return all(row.get(k, object()) == v for k, v in pair)


def _label(op: str, i: int, row: dict) -> str:
    short = {"softmax": "", "sigmoid": "sigmoid", "list": "", "stacked": "stacked", "tuple": "tuple"}
    parts = [f"r{i}"]
    for k, v in row.items():
        if k == "dtype":
            continue
        if k == "out_norm":
            parts += [] if v == "off" else ["outnorm"] if v == "eps" else [f"outnorm_eps{v:g}"]
        elif isinstance(v, bool):
            parts += [{"key_norm": "nokn", "token_query": "tokq", "gain": "nogain", "lse": "lse"}[k]] \
                if v != (k in ("key_norm", "gain")) else []
        elif isinstance(v, str):
            parts += [short[v]] if short.get(v) else []
        elif k == "num_heads":
            parts += [f"H{v}"] if v != 1 else []
        elif v is not None and not (k == "eps" and v == 1e-6) and not (k == "scale" and v == 1.0):
            parts.append(f"{k.replace('_', '')}{v:g}")
    return "-".join(parts)


def covering_cases(dtypes, declared=None) -> list:
    """One case per row of each op's pairwise covering array, in the row `covering/<op>`; the
    dtype is one of its parameters, over `dtypes` (those the port declares, `declared`, when given),
    so every option value meets every declared dtype."""
    from .cases import _op_case

    dts = tuple(d for d in dtypes if declared is None or d in declared) or tuple(dtypes)[:1]
    cases = []
    for op, params in PARAMS.items():
        builder = {"depth_attention": "da", "depth_attention_multi": "multi", "merge_partial": "merge"}[op]
        params = tuple((n, dts if n == "dtype" else v) for n, v in params)
        for i, row in enumerate(pairwise(params)):
            row = dict(row)
            dtype = row.pop("dtype")
            kw = dict(row, tokens=(2, 3) if row.get("token_query") else (3,), dim=8)
            if builder == "da":
                kw.update(n=5)
                norm = kw.pop("out_norm")
                if norm != "off":
                    kw["out_norm"] = True
                    if norm != "eps":
                        kw["out_norm_eps"] = norm
            elif builder == "multi":
                kw.update(n=4, s=2)
            cases.append(_op_case(f"covering/{op}", _label(op, i, row), dtype, builder, False, **kw))
    return cases


__all__ = ["PARAMS", "allowed", "covering_cases", "pairwise"]
