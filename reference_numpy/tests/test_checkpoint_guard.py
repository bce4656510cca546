"""attnres_core.checkpoint: the guard a converted model's config.json carries (what the three
backends' savers write and their loaders undo)."""

import pytest
from attnres_core import checkpoint as ck

CONFIG = {"model_type": "attnres", "use_cache": False, "tie_word_embeddings": True,
          "attnres": {"config": {"kind": "block"}, "base_model_type": "llama"}}


def test_guard_moves_the_field_into_the_record_and_unguard_restores_it():
    guarded = ck.guard(CONFIG)
    assert guarded["use_cache"] == ck.GUARD_TEXT and ck.guarded_field(guarded) == "use_cache"
    assert guarded["attnres"]["guard"] == {"field": "use_cache", "value": False}
    assert ck.unguard(guarded) == CONFIG and CONFIG["use_cache"] is False  # the input is not modified
    assert ck.guard(guarded) == guarded  # idempotent, on the field already guarded
    assert ck.unguard(CONFIG) == CONFIG and ck.guarded_field(CONFIG) is None  # saved before the guard


def test_the_other_field_and_a_default_left_out_of_a_diff_dict():
    tied = ck.guard(CONFIG, "tie_word_embeddings")
    assert tied["tie_word_embeddings"] == ck.GUARD_TEXT and tied["use_cache"] is False
    assert ck.guard(ck.unguard(tied), ck.guarded_field(tied)) == tied
    diff = {k: v for k, v in CONFIG.items() if k != "use_cache"}
    assert ck.guard(diff, value=True)["attnres"]["guard"]["value"] is True
    assert "use_cache" not in ck.unguard(ck.guard(diff))  # no value known: the family's default


def test_refusals():
    with pytest.raises(ValueError, match="no 'attnres' record"):
        ck.guard({"model_type": "llama", "use_cache": True})
    with pytest.raises(ValueError, match="field: expected one of"):
        ck.guard(CONFIG, "num_hidden_layers")
