"""The shared public API table (`signatures.json`, issue 17): the reference agrees with it, the
table is well formed, and the checker reports each kind of disagreement (a renamed keyword, a
reordered or re-kinded parameter, a changed default, a missing or unlisted name, a stale
allowlist entry) on fake backend modules.  Each backend's own test session checks its real
surface (backend_*/tests/test_signatures.py): no environment here has all three frameworks."""

import types

import attnres_numpy
import pytest
from attnres_conformance import signatures as sig


def test_the_reference_agrees_with_the_table():
    assert sig.mismatches("numpy") == []


def test_table_is_well_formed():
    table = sig.load()
    backends = set(sig.SURFACES)
    for name, entry in table["signatures"].items():
        assert set(entry["backends"]) <= backends and len(entry["backends"]) >= 2, name
        assert sum(k in entry for k in ("signature", "methods", "same_as")) == 1, name
        texts = [entry["signature"]] if "signature" in entry else list(entry.get("methods", {}).values())
        for text in texts:  # the notation round-trips, so messages show what the file says
            assert sig.render(sig.parse(text)) == text, (name, text)
    for key in ("extras", "missing", "backend_only"):
        for backend, entries in table[key].items():
            assert backend in backends, (key, backend)
            for name, value in entries.items():
                reasons = value.values() if isinstance(value, dict) else [value]
                assert all(isinstance(r, str) and len(r) > 20 for r in reasons), (key, backend, name)
    for backend, entries in table["extras"].items():  # extras only on shared names of that backend
        for key in entries:
            entry = table["signatures"][key.split(".")[0]]
            assert backend in entry["backends"], (backend, key)


def test_parse_and_render():
    params = sig.parse("(a, /, b, c=None, *args, d, e='x', **kw)")
    assert params == [("a", "positional-only", None), ("b", "positional or keyword", None),
                      ("c", "positional or keyword", "None"), ("args", "variadic positional", None),
                      ("d", "keyword-only", None), ("e", "keyword-only", "'x'"), ("kw", "variadic keyword", None)]
    assert sig.render(params) == "(a, /, b, c=None, *args, d, e='x', **kw)"

    def f(a, /, b, c=None, *args, d, e="x", **kw):
        pass

    assert sig.describe(f) == params
    assert sig.parse("(x, *, eps=1e-6)")[1][2] == repr(1e-6)  # defaults compare by repr
    with pytest.raises(ValueError, match="not a Python parameter list"):
        sig.parse("(x, eps=)")


# -- the checker on fake backends ----------------------------------------------------------
TABLE = {
    "signatures": {
        "op": {"backends": ["torch", "jax"], "signature": "(x, w=None, *, eps=1e-06, scale=1.0)"},
        "Layer": {"backends": ["torch", "jax"],
                  "methods": {"__init__": "(dim, *, eps=1e-06)", "__call__": "(x, *, return_lse=False)"}},
    },
    "backend_only": {"torch": {"helper": "a torch-only helper, for the test"}},
    "extras": {"jax": {"op": {"impl": "a framework-specific keyword, for the test"}}},
    "missing": {},
}


def op(x, w=None, *, eps=1e-6, scale=1.0):
    pass


def helper():
    pass


class Layer:
    def __init__(self, dim, *, eps=1e-6):
        pass

    def __call__(self, x, *, return_lse=False):
        pass


def module(**names):
    m = types.ModuleType("fake_backend")
    m.__all__ = list(names)
    for n, v in names.items():
        setattr(m, n, v)
    return m


def check(backend, **names):
    return sig.mismatches(backend, [module(**names)], TABLE)


def test_fake_backends_that_agree_pass():
    assert check("torch", op=op, Layer=Layer, helper=helper) == []

    def jax_op(x, w=None, *, eps=1e-6, scale=1.0, impl=None):
        pass

    assert check("jax", op=jax_op, Layer=Layer) == []


def test_renamed_keyword_fails():
    problems = check("torch", op=sig.renamed(op, "eps", "epsilon"), Layer=Layer, helper=helper)
    assert len(problems) == 1 and "torch.op" in problems[0]
    assert "unexpected ['epsilon']" in problems[0] and "missing ['eps']" in problems[0]


@pytest.mark.parametrize("src, expect", [
    ("def f(w=None, x=None, *, eps=1e-06, scale=1.0): pass", "different order"),
    ("def f(x, w=None, *, scale=1.0, eps=1e-06): pass", "different order"),
    ("def f(x, w=None, eps=1e-06, scale=1.0): pass", "'eps' is positional or keyword, expected keyword-only"),
    ("def f(x, w=None, *, eps=1e-05, scale=1.0): pass", "'eps' defaults to 1e-05, expected 1e-06"),
    ("def f(x, w, *, eps=1e-06, scale=1.0): pass", "'w' defaults to nothing, expected None"),
    ("def f(x, w=None, *, eps=1e-06): pass", "missing ['scale']"),
])
def test_each_disagreement_is_named(src, expect):
    scope = {}
    exec(src, scope)  # a literal def: the parameters are what the test is about
    problems = check("torch", op=scope["f"], Layer=Layer, helper=helper)
    assert len(problems) == 1 and expect in problems[0], problems


def test_method_disagreements():
    class Bad(Layer):
        def __call__(self, x, return_lse=False):
            pass

    problems = check("torch", op=op, Layer=Bad, helper=helper)
    assert len(problems) == 1 and "torch.Layer.__call__" in problems[0] and "keyword-only" in problems[0]

    class Forward:  # a torch nn.Module is called through forward
        def __init__(self, dim, *, eps=1e-6):
            pass

        def forward(self, x, *, return_lse=False, return_weights=False):
            pass

    problems = check("torch", op=op, Layer=Forward, helper=helper)
    assert len(problems) == 1 and "unexpected ['return_weights']" in problems[0]


def test_names_must_be_accounted_for():
    problems = check("torch", op=op, helper=helper, stray=helper)
    assert any("torch.Layer: listed in signatures.json but not exported" in p for p in problems)
    assert any("torch.stray: public, but neither" in p for p in problems)
    assert any("backend_only but not exported" in p for p in check("torch", op=op, Layer=Layer))
    # a shared name exported by a backend the table does not list for it
    table = {**TABLE, "signatures": {**TABLE["signatures"], "op": {**TABLE["signatures"]["op"], "backends": ["jax"]}}}
    problems = sig.mismatches("torch", [module(op=op, Layer=Layer, helper=helper)], table)
    assert problems == ["torch.op: exported but signatures.json does not list 'torch' among its backends"]


def test_allowlist_entries_are_checked():
    problems = check("jax", op=op, Layer=Layer)  # jax's extra `impl` is gone: stale entry
    assert problems == ["jax.op: allowlisted extra 'impl' is not a parameter any more (remove it from signatures.json)"]

    def positional_extra(x, impl=None, w=None, *, eps=1e-6, scale=1.0):
        pass

    problems = check("jax", op=positional_extra, Layer=Layer)
    assert len(problems) == 1 and "positional before a shared positional" in problems[0]

    def extra_not_allowed(x, w=None, *, eps=1e-6, scale=1.0, impl=None, stream=None):
        pass

    problems = check("jax", op=extra_not_allowed, Layer=Layer)
    assert len(problems) == 1 and "unexpected ['stream']" in problems[0]


def test_same_as_requires_the_very_object():
    table = {"signatures": {"ResidualConfig": {"backends": ["torch", "jax"],
                                               "same_as": "attnres_core.config.ResidualConfig"}}}
    assert sig.mismatches("torch", [module(ResidualConfig=attnres_numpy.ResidualConfig)], table) == []

    class ResidualConfig:  # a look-alike copy is not the shared config
        pass

    problems = sig.mismatches("torch", [module(ResidualConfig=ResidualConfig)], table)
    assert problems == ["torch.ResidualConfig: must be attnres_core.config.ResidualConfig itself (a re-export)"]


def test_the_real_table_catches_a_renamed_keyword_in_the_reference(monkeypatch):
    """Seen failing on the packaged table: the reference with `eps` renamed."""
    monkeypatch.setattr(attnres_numpy, "merge_partial", sig.renamed(attnres_numpy.merge_partial, "eps", "epsilon"))
    problems = sig.mismatches("numpy")
    assert len(problems) == 1 and problems[0].startswith("numpy.merge_partial: signature")
    assert "unexpected ['epsilon']" in problems[0]


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend: expected one of numpy, torch, jax, mlx, got 'pytorch'"):
        sig.mismatches("pytorch")


def test_cli_prints_mismatches(capsys):
    assert sig.main(["numpy"]) == 0
    assert "numpy: 0 mismatch(es) with signatures.json" in capsys.readouterr().out


# -- the dispatch contract (signatures.json "dispatch"; issue 41) -----------------------------------


def _dispatch_module(**changes):
    """A fake `attnres_jax.dispatch` that keeps the contract, with `changes` applied."""
    from attnres_core import dispatch as core

    def use_impl(name, **options):
        pass

    module = types.SimpleNamespace(
        IMPLEMENTATIONS=("pallas", "xla"), Choice=core.Choice, use_impl=use_impl,
        availability=lambda: {"pallas": "no GPU or TPU here", "xla": None},
        capabilities=lambda: {"dtypes": (), "devices": (), "fused_kernel": False,
                              "deterministic": True},
        last_choice=lambda: None, impl_counts=lambda: {})
    for name, value in changes.items():
        if value is None:
            delattr(module, name)
        else:
            setattr(module, name, value)
    return module


def test_dispatch_contract_is_well_formed():
    contract = sig.load()["dispatch"]
    assert set(contract["backends"]) == set(contract["implementations"]) <= set(sig.SURFACES)
    for text in contract["signatures"].values():
        assert sig.render(sig.parse(text)) == text
    assert sig.dispatch_mismatches("numpy") == []  # the reference has no dispatch module


def _renamed_use_impl(impl, **options):
    pass


@pytest.mark.parametrize("changes, expected", [
    ({"use_impl": _renamed_use_impl}, "attnres_jax.dispatch.use_impl: signature"),
    ({"last_choice": None}, "attnres_jax.dispatch.last_choice: missing"),
    ({"Choice": __import__("collections").namedtuple("Choice", "op impl refused")},
     "attnres_jax.dispatch.Choice: must be attnres_core.dispatch.Choice itself"),
    ({"IMPLEMENTATIONS": ("xla", "pallas")}, "attnres_jax.dispatch.IMPLEMENTATIONS: ('xla', 'pallas')"),
    ({"IMPLEMENTATIONS": ["pallas", "xla"]}, "attnres_jax.dispatch.IMPLEMENTATIONS: ['pallas', 'xla']"),
    ({"availability": lambda: {"xla": None}}, "attnres_jax.dispatch.availability(): keys ['xla']"),
    ({"availability": lambda: {"pallas": "", "xla": None}},
     "attnres_jax.dispatch.availability()['pallas']: ''"),
    ({"capabilities": lambda: {"dtypes": ()}}, "attnres_jax.dispatch.capabilities(): keys ['dtypes']"),
])
def test_dispatch_contract_reports_each_departure(changes, expected):
    assert sig.dispatch_mismatches("jax", _dispatch_module()) == []
    problems = sig.dispatch_mismatches("jax", _dispatch_module(**changes))
    assert len(problems) == 1 and problems[0].startswith(expected), problems
