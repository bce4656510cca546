"""Issue 44 item 2: pairwise covering arrays of each op's options (`attnres_conformance.covering`)."""

from itertools import combinations

from attnres_conformance import covering


def test_every_allowed_pair_is_covered_and_constraints_hold():
    for op, params in covering.PARAMS.items():
        rows = covering.pairwise(params)
        values = dict(params)
        for a, b in combinations(values, 2):
            for va in values[a]:
                for vb in values[b]:
                    if covering.allowed({a: va, b: vb}):
                        assert any(r[a] == va and r[b] == vb for r in rows), (op, a, va, b, vb)
        assert all(covering.allowed(r) for r in rows)
        full = 1
        for v in values.values():
            full *= len(v)
        assert len(rows) <= 25 < full  # a covering array, not the product


def test_cases_follow_the_declared_dtypes():
    cases = covering.covering_cases(("float64", "float32", "float16", "bfloat16"), declared=("float32",))
    assert cases and {c.dtype for c in cases} == {"float32"}
    assert len({c.id for c in cases}) == len(cases)
