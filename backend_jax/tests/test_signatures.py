"""The public API of attnres_jax agrees with the one table every backend is held to
(`attnres_conformance/signatures.json`: names, order, kinds and defaults of every shared op and
class; framework-specific extras only from its allowlist, each with its reason), issue 17."""

import attnres_jax
from attnres_conformance import signatures


def test_public_signatures_agree_with_the_shared_table():
    problems = signatures.mismatches("jax")
    assert problems == [], "\n".join(problems)


def test_a_renamed_keyword_fails(monkeypatch):
    """Seen failing: `scale` renamed to `logit_scale` in the real depth_attention."""
    monkeypatch.setattr(attnres_jax, "depth_attention",
                        signatures.renamed(attnres_jax.depth_attention, "scale", "logit_scale"))
    problems = signatures.mismatches("jax")
    assert len(problems) == 1 and problems[0].startswith("jax.depth_attention: signature"), problems
    assert "unexpected ['logit_scale']" in problems[0] and "missing ['scale']" in problems[0]


def test_a_changed_module_default_fails(monkeypatch):
    """Seen failing: the Flax DepthRouter.__call__'s `mix` default changed."""
    from attnres_jax import modules

    def call(self, embedding, sublayers, *, schedule="direct", mix=1.0, scale=None, observer=None,
             remat=None):
        pass

    monkeypatch.setattr(modules.DepthRouter, "__call__", call)
    problems = signatures.mismatches("jax")
    assert len(problems) == 1 and "'mix' defaults to 1.0, expected None" in problems[0], problems
