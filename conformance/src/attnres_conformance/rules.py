"""Why each row exists: the spec rule it checks and the reason its cases look the way they do.

A failure names its rule and reason (`explain`), so a porter reads "C10.6: at |x| = 1e20 ..."
instead of a bare error figure; `hint` adds what the size of a numerical error suggests.
The table is keyed by a row's last id segment (`depth_attention/large_magnitude` ->
"large_magnitude"), then by the row's first segment for whole families (probe, errors, ...).
"""

from __future__ import annotations

from typing import Optional, Tuple

#: row segment -> (spec rule, why the row's cases are what they are).
ROW_RULES = {
    "sources_past_32": ("C1, C16", "N = 33 and 130 must use every source: a source cap or tile "
                                   "remainder silently drops sources (Liger-kernel 0.8.3 dropped every "
                                   "source past 32)"),
    "shapes": ("C1, C2, C16", "N past 32 and 128 and D odd, 1 or past 4096 cross kernel tile boundaries; "
                              "every source and every channel must count"),
    "odd_tokens": ("C2", "any number of token axes, odd counts, no token axis at all"),
    "empty_tokens": ("C2", "an empty token axis gives empty outputs and zero parameter gradients"),
    "large": ("C16", "sizes large in one axis (N = 300 past a 256-source tile, D = 4100 past 4096, "
                     "T = 4096): chunking of sources, channels or tokens must not drop or double data"),
    "large_magnitude": ("C10.6", "the key norm is scale-invariant: at |x| = 1e15 s·r³·x/D underflows a "
                                 "float32 gradient and at 1e20 mean(x²) overflows float32 unless evaluated "
                                 "scale-safely (x / max|x| first); fp64 at 1e100 likewise"),
    "large_logits": ("C10.4", "logits of ~120 (real models see 50-150): softmax and lse must subtract the "
                              "max logit (exp overflows past 88 in fp32, 709 in fp64)"),
    "nonfinite": ("C12", "NaN / ±Inf propagate to their own tokens only: no cross-token reduction "
                         "(a global max or norm) may spread them, and no value is inspected or replaced"),
    "zero_sources": ("C10.6", "all-zero sources: r = 1/sqrt(eps) exactly, in the forward and in the VJP"),
    "query_dtype": ("C10.1", "a query in its own dtype is converted to the compute dtype, its gradient "
                             "returned in its own dtype"),
    "out_norm": ("C17", "the fused output norm over all D, from `out` before its rounding, with its own "
                        "eps and gain dtype, and its cotangent reaching every gradient"),
    "forward_only": ("C10", "a call without cotangents may run another program than the gradient call: "
                            "it is checked on its own"),
    "weights": ("C11", "every weight of every source (N past 40 and 128), non-differentiable"),
    "lse": ("C9", "lse = logsumexp(z) in the compute dtype, and its cotangent in every gradient"),
    "eps_scale": ("C8, 2.1", "eps inside the key norm's square root and the logit scale on every logit"),
    "small_partial_weight": ("C10.7", "a partial whose weight is e^-20 at every token: 1 - w1 must not be "
                                      "formed in float32"),
    "strided": ("C2", "non-contiguous inputs (a view of every other element)"),
    "stacked": ("section 1", "sources as one stacked [N, ..., D] array"),
    "tuple_sources": ("section 1", "a tuple of sources is a list"),
    "heads": ("C9", "num_heads > 1: one logit per head over D / H channels"),
    "sigmoid": ("C9", "activation='sigmoid': independent weights, no lse"),
    "no_key_norm": ("2.1", "key_norm=False: the raw sources as keys"),
    "per_token_query": ("C4", "a query per token, [..., D]"),
    "no_gain": ("C5", "norm_weight None"),
    "base": ("2.1", "the op's definition"),
    "combo": ("2.1", "options combined"),
    "limits": ("C16", "exactly the declared limit runs"),
    "two_phase": ("section 3", "phase 1 plus the merge equals the direct call and the reference"),
    "identity": ("C6", "N = 1 returns the source bitwise, weights 1, lse = z_0"),
    "weights_sum": ("C11", "softmax weights sum to 1 per token and head"),
    "zero_query_uniform": ("M8", "a zero query (every model's initialization) gives uniform weights"),
    "hypothesis": ("2.1", "a derandomized sweep of option combinations"),
    "sublayer_dtype": ("M1a", "probe sublayers returning another dtype than the embedding's: each v_l is cast "
                              "to the embedding's dtype as it enters the stream, so out keeps that dtype "
                              "(not the sublayers', not the widest seen) and the cotangent reaching v_l "
                              "comes back in v_l's dtype"),
}
def _transform_rules() -> dict:
    from .transforms import TRANSFORMS

    return {t.name: (t.rule, f"transform '{t.name}': {t.why}") for t in TRANSFORMS}


ROW_RULES.update(_transform_rules())
#: First id segment -> (rule, why) for whole families.
FAMILY_RULES = {
    "probe": ("section 6", "the probe network of the named variant, every parameter's gradient"),
    "errors": ("section 7", "the spec's error: its type, the argument named, inputs untouched"),
    "sequences": ("C8, section 7", "the same signature called again with changed scalars, then with an invalid "
                                   "one: a per-signature plan cache must neither keep the first call's scale "
                                   "nor skip the scalar checks on a repeat"),
    "cotangents": ("2.3, section 7", "a cotangent of the wrong shape, a broadcastable one or another dtype: a "
                                     "clear error naming the cotangent (or the framework's own autodiff error), "
                                     "never a silent broadcast; a cast dtype gives the cast cotangent's gradients"),
    "determinism": ("C15", "two identical runs bitwise equal: no atomics or thread-count-dependent "
                           "reduction orders (checked past 4096 positions too)"),
    "golden": ("spec/vectors", "a committed golden vector"),
    "sweep": ("2.1", "a derandomized sweep of option combinations"),
    "autocast": ("C3a", "inside the framework's autocast region, sources of mixed dtypes are widened to the "
                        "widest (float16 with bfloat16: float32) and the op computes by C10 with the region's "
                        "casts off; each gradient comes back in its own source's dtype"),
    "covering": ("2.1", "a pairwise covering array of the op's options (heads, activation, key norm, query "
                        "form, gain, lse, layout, eps, scale, output norm and its eps, dtype): every pair of "
                        "values meets in some case"),
}


def rule_of(row: str) -> Optional[Tuple[str, str]]:
    """(spec rule, why) of a matrix row, or None."""
    parts = row.split("/")
    for part in reversed(parts):
        if part in ROW_RULES:
            return ROW_RULES[part]
    return FAMILY_RULES.get(parts[0])


def hint(dtype: str, err: Optional[float]) -> str:
    """What the size of a numerical error suggests ("" when nothing in particular)."""
    if err is None or err != err or err == float("inf"):
        return ""
    if dtype == "float64" and 1e-9 < err < 1e-4:
        return "an fp32-sized error in a float64 case: a float32 intermediate (C10: kappa is float64)"
    if dtype == "float32" and 1e-4 < err < 5e-2:
        return "an fp16/bf16-sized error in a float32 case: a low-precision intermediate or accumulation (C10)"
    if dtype in ("float16", "bfloat16") and 1e-2 < err < 0.5:
        return ("a low-precision accumulation: sums over sources or tokens must run in float32 "
                "with one final rounding (C10)")
    if err >= 0.5:
        return "an O(1) error: a wrong formula, a dropped input or a missing term, not rounding"
    return ""


def explain(row: str, dtype: str, err: Optional[float]) -> str:
    """One line for a failure: the rule, why the row exists, and the hint."""
    found = rule_of(row)
    parts = [] if found is None else [f"{found[0]}: {found[1]}"]
    h = hint(dtype, err) if not row.startswith(("errors/", "determinism")) else ""
    if h:
        parts.append(h)
    return "; ".join(parts)
