"""Golden vectors: the committed spec/vectors match their definitions (drift), the rounding
helper is exact, and the files round-trip (spec/VECTORS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from attnres_core.config import VARIANT_KINDS, ResidualConfig
from attnres_numpy import vectors

COMMITTED = Path(__file__).resolve().parents[2] / "spec" / "vectors"
MAX_BYTES = 2 * 1024 * 1024
VALUE_RTOL = 1e-12


@pytest.fixture(scope="module")
def cases():
    return vectors.golden_cases()


@pytest.fixture(scope="module")
def committed():
    assert (COMMITTED / vectors.MANIFEST).is_file(), f"{COMMITTED} has no manifest: run `nox -s vectors`"
    return vectors.load_manifest(COMMITTED), {c.id: c for c in vectors.load_vectors(COMMITTED)}


# -- round_to_dtype ----------------------------------------------------------------------------


def _probe_values(rng):
    """Wide exponent range (subnormals of every format, overflow), exact ties, specials."""
    wide = rng.standard_normal(20000) * np.exp2(rng.integers(-160, 140, 20000))
    ties = np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8,
                     1 + 2.0 ** -24, 1 + 3 * 2.0 ** -24, 65520.0, 65519.99, 2.0 ** -25, 3 * 2.0 ** -26])
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 1e308, -1e308, 5e-324])
    return np.concatenate([wide, ties, -ties, specials])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_round_to_dtype_matches_numpy_casts(dtype):
    x = _probe_values(np.random.default_rng(0))
    with np.errstate(over="ignore"):
        expected = x.astype(dtype).astype(np.float64)
    got = vectors.round_to_dtype(x, dtype)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(expected))


def _bf16_by_bits(x32: np.ndarray) -> np.ndarray:
    """Independent bf16 rounding of finite float32 values: round-to-nearest-even on the bits."""
    bits = x32.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


def test_round_to_dtype_bfloat16_matches_bit_rounding():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2 ** 32, 50000, dtype=np.uint64).astype(np.uint32)
    x32 = bits.view(np.float32)
    x32 = x32[np.isfinite(x32)]
    ties = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, float.fromhex("0x1.ff8p127")], dtype=np.float32)
    x32 = np.concatenate([x32, ties, -ties])
    np.testing.assert_array_equal(vectors.round_to_dtype(x32.astype(np.float64), "bfloat16"),
                                  _bf16_by_bits(x32))


def test_round_to_dtype_keeps_nan_float64_and_input():
    x = np.array([np.nan, 1.0 + 2.0 ** -40, -3.5])
    before = x.copy()
    assert np.isnan(vectors.round_to_dtype(x, "bfloat16")[0])
    np.testing.assert_array_equal(vectors.round_to_dtype(x, "float64"), x)
    np.testing.assert_array_equal(x, before)


def test_round_to_dtype_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="dtype"):
        vectors.round_to_dtype(np.ones(3), "int8")


# -- drift: committed files vs definitions ---------------------------------------------------


def test_committed_case_set_equals_definitions(cases, committed):
    manifest, _ = committed
    assert [e["id"] for e in manifest["cases"]] == [c.id for c in cases]
    assert manifest["schema_version"] == vectors.SCHEMA_VERSION
    assert manifest["generator"] == vectors.GENERATOR
    # Every per-case field (op, attrs, dtype, layout, seed, tolerance class, shapes, dtypes, file).
    for entry, case in zip(manifest["cases"], cases):
        assert entry == json.loads(json.dumps(vectors.manifest_entry(case))), case.id


def test_committed_values_match_reference(cases, committed):
    _, stored = committed
    for case in cases:
        got = stored[case.id].arrays
        assert sorted(got) == sorted(case.arrays), case.id
        for key, expected in case.arrays.items():
            if key.startswith(("input.", "cotangent.")):
                np.testing.assert_array_equal(got[key], expected, err_msg=f"{case.id} {key}")
            else:
                atol = VALUE_RTOL * max(1.0, float(np.max(np.abs(expected), initial=0.0)))
                np.testing.assert_allclose(got[key], expected, rtol=VALUE_RTOL, atol=atol,
                                           err_msg=f"{case.id} {key}")


def test_committed_set_is_small():
    total = sum(p.stat().st_size for p in COMMITTED.iterdir() if p.is_file())
    assert 0 < total < MAX_BYTES


# -- what the cases are ----------------------------------------------------------------------


def test_inputs_are_representable_in_their_dtypes(cases):
    for case in cases:
        for key, dtype in vectors.value_dtypes(case).items():
            value = case.arrays[key]
            assert value.dtype == np.float64
            if key.startswith(("input.", "cotangent.")):
                np.testing.assert_array_equal(vectors.round_to_dtype(value, dtype), value,
                                              err_msg=f"{case.id} {key} is not {dtype}")
            assert np.all(np.isfinite(value)), f"{case.id} {key}"


def test_cases_cover_every_op_option_shape_and_dtype(cases):
    ops = {c.op for c in cases}
    assert ops == set(vectors.OPS)
    for op in ("depth_attention", "depth_attention_multi", "merge_partial"):
        assert {c.dtype for c in cases if c.op == op} == set(vectors.DTYPES), op
    da = [c for c in cases if c.op == "depth_attention"]
    assert {c.arrays["input.sources"].shape[0] for c in da} >= {1, 2, 33, 130}
    assert {c.arrays["input.sources"].shape[-1] for c in da} >= {1, 7, 123}
    assert {c.sources_layout for c in da} == {"list", "stacked"}
    assert {c.sources_layout for c in cases if c.op == "depth_attention_multi"} == {"list", "stacked"}
    assert {c.attrs["num_heads"] for c in da} >= {1, 2, 3}
    assert {c.attrs["activation"] for c in da} == {"softmax", "sigmoid"}
    assert {c.attrs["key_norm"] for c in da} == {True, False}
    assert {c.attrs["return_lse"] for c in da} == {True, False}
    assert {c.attrs["return_weights"] for c in da} == {True, False}
    assert any(c.arrays["input.query"].ndim > 1 for c in da)
    assert any("input.norm_weight" not in c.arrays for c in da)
    fused = [c for c in da if "input.out_norm_weight" in c.arrays]  # C17
    assert {c.dtype for c in fused} == set(vectors.DTYPES)
    assert {c.attrs["num_heads"] for c in fused} >= {1, 2} and any("out_norm_eps" in c.attrs for c in fused)
    assert all({"output.out_normed", "cotangent.out_normed", "grad.out_norm_weight"} <= set(c.arrays) for c in fused)
    assert any("input.query" in c.arrays and c.arrays["input.query"].ndim > 1
               for c in cases if c.op == "merge_partial")


def test_probe_cases_cover_every_variant_block_size_and_schedule(cases):
    probes = [c for c in cases if c.op == "probe"]
    configs = [c.attrs["config"] for c in probes]
    assert {c.attrs["variant"] for c in probes} == set(VARIANT_KINDS)
    for case in probes:
        variant = ResidualConfig.variant(case.attrs["variant"]).to_dict()
        # A variant's sizes may vary (M13: r), and M15's flag lies over any attention variant.
        sizes = ("block_size", "window", "key_rank", "fuse_out_norm")
        assert {k: v for k, v in case.attrs["config"].items() if k not in sizes} == \
            {k: v for k, v in variant.items() if k not in sizes}, case.id
    blocks = [(cfg["block_size"], c.arrays["input.sublayer_weights"].shape[0])
              for cfg, c in zip(configs, probes) if cfg["kind"] == "block"]
    assert {s for s, _ in blocks} >= {1, 2, 4}
    assert any(num_layers % s for s, num_layers in blocks), "an uneven last block"
    two_phase = [c for c in probes if c.attrs["schedule"] == "two_phase"]
    assert two_phase and all(not any(k.startswith(("grad.", "cotangent.")) for k in c.arrays)
                             for c in two_phase)
    for case in probes:
        if case.attrs["schedule"] == "direct":
            grads = {k for k in case.arrays if k.startswith("grad.")}
            inputs = {k for k in case.arrays if k.startswith("input.")}
            assert {k.replace("grad.", "input.", 1) for k in grads} == inputs, case.id


def test_single_source_cases_return_the_source_exactly(cases):
    """C6, checked on the stored vectors themselves."""
    singles = [c for c in cases if c.op == "depth_attention" and c.arrays["input.sources"].shape[0] == 1]
    assert singles
    for case in singles:
        np.testing.assert_array_equal(case.arrays["output.out"], case.arrays["input.sources"][0])


# -- files -----------------------------------------------------------------------------------


def test_write_is_byte_reproducible_and_round_trips(cases, tmp_path):
    subset = cases[:3] + cases[-3:]
    first, second = tmp_path / "a", tmp_path / "b"
    vectors.write_vectors(first, subset)
    (second).mkdir()
    (second / "stale_case.npz").write_bytes(b"old")
    vectors.write_vectors(second, subset)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    assert "stale_case.npz" not in names and len(names) == len(subset) + 1
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    for case, loaded in zip(subset, vectors.load_vectors(first)):
        assert (loaded.id, loaded.op, loaded.attrs, loaded.dtype, loaded.sources_layout, loaded.seed,
                loaded.tolerance_class) == (case.id, case.op, case.attrs, case.dtype,
                                            case.sources_layout, case.seed, case.tolerance_class)
        assert sorted(loaded.arrays) == sorted(case.arrays)
        for key in case.arrays:
            np.testing.assert_array_equal(loaded.arrays[key], case.arrays[key])


def test_write_rejects_duplicate_ids(cases, tmp_path):
    with pytest.raises(ValueError, match="duplicate"):
        vectors.write_vectors(tmp_path, [cases[0], cases[0]])


def test_load_rejects_other_schema_and_mismatched_files(cases, tmp_path):
    vectors.write_vectors(tmp_path, cases[:1])
    manifest = json.loads((tmp_path / vectors.MANIFEST).read_text())
    manifest["cases"][0]["shapes"]["output.out"] = [99]
    (tmp_path / vectors.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="do not match the manifest"):
        vectors.load_vectors(tmp_path)
    manifest["schema_version"] = vectors.SCHEMA_VERSION + 1
    (tmp_path / vectors.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="schema_version"):
        vectors.load_vectors(tmp_path)


def test_default_vectors_dir(tmp_path, monkeypatch):
    found = tmp_path / "repo" / "spec" / "vectors"
    found.mkdir(parents=True)
    (found / vectors.MANIFEST).write_text("{}")
    nested = tmp_path / "repo" / "a" / "b"
    nested.mkdir(parents=True)
    monkeypatch.delenv(vectors.ENV_VAR, raising=False)
    monkeypatch.chdir(nested)
    assert vectors.default_vectors_dir() == found
    monkeypatch.setenv(vectors.ENV_VAR, str(found))
    assert vectors.default_vectors_dir() == found
    monkeypatch.setenv(vectors.ENV_VAR, str(tmp_path / "missing"))
    assert vectors.default_vectors_dir() is None


def test_cli_writes_the_golden_set(tmp_path, capsys):
    assert vectors.main([str(tmp_path)]) == 0
    assert "cases" in capsys.readouterr().out
    manifest = vectors.load_manifest(tmp_path)
    assert len(manifest["cases"]) == len(list(tmp_path.glob("*.npz")))
    assert vectors.main([]) == 2
