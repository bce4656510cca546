"""The support matrix (`attnres_conformance.matrix`): the committed tables in README.md and
docs/status.md are what the committed snapshot renders, and the renderer reads real reports
(built by `runner.Report`, not hand-written dicts) without losing a failure, a skip or a dtype."""

import json
from pathlib import Path

import pytest
from attnres_conformance import matrix
from attnres_conformance.checks import Cell
from attnres_conformance.legend import document_dict
from attnres_conformance.runner import CaseResult, Report

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = ROOT / "docs" / "data" / "support.json"
#: Every document that shows the matrix, and whether its block is the detailed one.
DOCUMENTS = {"README.md": False, "docs/status.md": True}
MACHINE = {"machine": "x86_64", "system": "Linux", "cpu": "Test CPU", "cores": 2}
in_checkout = pytest.mark.skipif(not SNAPSHOT.is_file(), reason="docs/ is not part of this checkout")


def _report(name="fake", results=(), quick=True, shard=None, implementations=None):
    caps = {"dtypes": ["float64", "float32"], "devices": ["cpu"]}
    return Report(name, name, {"fake": "1.0"}, caps, ["cpu"], ["float64", "float32"], quick, list(results),
                  date="2026-12-02T00:00:00Z", commit="0123456789abcdef", implementations=implementations,
                  shard=shard)


def _result(case_id, dtype, forward, gradient=None):
    return CaseResult(case_id, case_id.rsplit("/", 1)[0], "op", dtype, "cpu", Cell(forward, 0.0),
                      None if gradient is None else Cell(gradient, 0.0))


def _document(*reports):
    return json.loads(json.dumps(document_dict(reports)))  # through JSON, as the CLI writes it


@in_checkout
@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_committed_matrix_is_what_the_snapshot_renders(name):
    data = json.loads(SNAPSHOT.read_text())
    text = (ROOT / name).read_text()
    found = matrix.blocks(text)
    assert [detail for detail, _ in found] == [DOCUMENTS[name]], f"{name}: expected one matrix block"
    expected = matrix.render(data, detail=DOCUMENTS[name])
    assert found[0][1] == expected, (
        f"{name}: the matrix differs from docs/data/support.json; refresh it with "
        "python -m attnres_conformance.matrix --snapshot docs/data/support.json "
        "--write README.md --write docs/status.md")


@in_checkout
def test_committed_snapshot_covers_every_backend_and_says_no_gpu_ran():
    data = json.loads(SNAPSHOT.read_text())
    assert sorted(b["spec"] for b in data["backends"]) == ["jax", "mlx", "numpy", "torch"]
    assert all(b["devices"] == ["cpu"] for b in data["backends"]), "a device run must change the text below"
    assert all(r["hardware"].startswith("none") for r in data["not_run"])
    readme = (ROOT / "README.md").read_text()
    assert "No GPU, TPU or Apple-silicon machine has run this code" in readme


def test_render_counts_every_check_and_shows_a_failure():
    results = [_result("op/a/1", "float64", "pass", "pass"), _result("op/a/2", "float64", "pass", "fail"),
               _result("op/b/1", "float32", "skip", "skip"), _result("op/b/2", "float32", "pass")]
    data = matrix.snapshot([_document(_report(results=results, implementations={"k": 3, "c": 5}))],
                           machine=MACHINE)
    entry = data["backends"][0]
    assert entry["checks"]["float64"]["gradient"] == {"pass": 1, "fail": 1, "xpass": 0, "xfail": 0, "skip": 0}
    text = matrix.render(data, detail=True)
    row = next(line for line in text.splitlines() if line.startswith("| `fake` | `c` (5), `k` (3)"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:5] == ["3/4 pass, 1 skip", "**1 FAIL**, 1/3 pass, 1 skip", "f64 **FAIL** f32"], cells
    assert "cpu: Test CPU, 2 cores (x86_64 Linux)" in cells[5]
    assert "| `fake` | f32 | 1/2 pass, 1 skip | 0/1 pass, 1 skip |" in text
    assert "quick (`--quick`) grid" in text and "0123456789ab" in text
    assert "| backend | dtype |" not in matrix.render(data), "the per-dtype table is the detailed block's"


def test_skips_in_undeclared_dtypes_leave_the_row_and_are_counted_below():
    results = [_result("op/a/1", "float64", "pass", "pass"), _result("op/a/1", "float32", "skip", "skip"),
               _result("op/a/2", "float32", "skip"), _result("op/a/3", "float16", "fail")]
    document = _document(_report(results=results))
    document["reports"][0]["capabilities"]["dtypes"] = ["float64"]
    text = matrix.render(matrix.snapshot([document], machine=MACHINE))
    row = next(line for line in text.splitlines() if line.startswith("| `fake` |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # the float16 failure ran, so it counts although float16 is not declared; the skips do not
    assert cells[2:4] == ["**1 FAIL**, 1/2 pass", "1/1 pass"], cells
    assert "`fake` declares f64 only: its 2 forward and 1 gradient checks in other dtypes are skipped" in text


def test_snapshot_rejects_shards_duplicates_and_nothing():
    one = _document(_report())
    with pytest.raises(ValueError, match="twice"):
        matrix.snapshot([one, one], machine=MACHINE)
    with pytest.raises(ValueError, match="shard"):
        matrix.snapshot([_document(_report(shard=(0, 2)))], machine=MACHINE)
    with pytest.raises(ValueError, match="no backend"):
        matrix.snapshot([{"reports": []}], machine=MACHINE)
    with pytest.raises(ValueError, match="snapshot_version"):
        matrix.render({"snapshot_version": 0})


def test_cli_refreshes_snapshot_and_blocks_and_check_detects_drift(tmp_path, capsys):
    reports = tmp_path / "run.json"
    reports.write_text(json.dumps(_document(_report(results=[_result("op/a/1", "float64", "pass", "pass")]))))
    snap = tmp_path / "support.json"
    kept = {"backend": "fake", "path": "GPU kernel", "forward": "interpreted", "backward": "interpreted",
            "dtypes": "f32", "hardware": "none"}
    snap.write_text(json.dumps({"snapshot_version": 1, "backends": [], "not_run": [kept]}))
    doc = tmp_path / "doc.md"
    original = "intro\n<!-- matrix:begin -->\nstale\n<!-- matrix:end -->\nafter\n"
    doc.write_text(original)
    args = ["--snapshot", str(snap), "--write", str(doc)]
    assert matrix.main([*args, "--check"]) == 1 and doc.read_text() == original, "--check writes nothing"
    assert matrix.main(["--reports", str(reports), *args]) == 0
    data = json.loads(snap.read_text())
    assert data["not_run"] == [kept], "the hand-kept rows survive a refresh"
    assert [b["spec"] for b in data["backends"]] == ["fake"]
    text = doc.read_text()
    assert text.startswith("intro\n<!-- matrix:begin -->\n| backend |") and text.endswith("<!-- matrix:end -->\nafter\n")
    assert "| `fake` | GPU kernel | interpreted |" in text
    assert matrix.main([*args, "--check"]) == 0
    (tmp_path / "bare.md").write_text("no markers\n")
    capsys.readouterr()
    assert matrix.main(["--snapshot", str(snap), "--write", str(tmp_path / "bare.md")]) == 2
    assert "no <!-- matrix:begin -->" in capsys.readouterr().err
