"""What a report says besides the matrix (issue 17): counts that add up to what is listed, the
implementation that ran, date / commit / wall time, the legend, and the JSON round trip."""

import dataclasses
import json
import re
import subprocess
import sys
from collections import Counter

import adapters
from attnres_conformance import legend, provenance
from attnres_conformance.reference_backend import ReferenceBackend
from attnres_conformance.runner import MATRIX_LABELS, Report, run_conformance

BASE = "depth_attention/base/N5-T3-D16/float64"
FEW = [BASE, "depth_attention/base/N5-T3-D16/float32", "errors/depth_attention/eps_nan/float64",
       "probe/full/L5-D8-T2x3/float64"]


class TwoDevices(ReferenceBackend):
    """The reference declaring two devices (NumPy runs both the same), so counts per device show."""

    name = "two_devices"

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), devices=("cpu", "cpu:1"))


class Counting(ReferenceBackend):
    """Reports which implementation ran each op call (`implementations_used`, cumulative), with
    calls already counted before the run: the report shows this run's calls only."""

    name = "counting"

    def __init__(self):
        self.used = {"fast": 7, "fallback": 3}

    def call_op(self, call):
        key = "fallback" if call.attrs.get("return_weights") else "fast"
        self.used[key] += 1
        return super().call_op(call)

    def implementations_used(self):
        return dict(self.used)


class Plain:
    """A backend without `implementations_used` (the method is optional): the reference, delegated."""

    name = "plain"

    def __init__(self):
        self.inner = ReferenceBackend()
        for method in ("is_available", "capabilities", "versions", "call_op", "call_probe"):
            setattr(self, method, getattr(self.inner, method))


class RaisingCount(ReferenceBackend):
    name = "raising_count"

    def implementations_used(self):
        raise RuntimeError("counter unavailable")


def _numbers(line):
    """'cases: 3 listed: 2 pass, 1 fail' -> {'pass': 2, 'fail': 1} (the label after each count)."""
    return {label: int(n) for n, label in re.findall(r"(\d+) (\S+?)(?:,|$)", line.split(": ", 2)[-1])}


def test_counts_add_up_to_what_is_listed_per_device():
    """Before: one 'cells:' line per device counted the forward/gradient checks of every device,
    and it is not what the matrix shows.  Now each count names what it counts and adds up."""
    report = run_conformance(TwoDevices(), case_ids=FEW)
    text = report.to_text()
    titles = [i for i, line in enumerate(text.splitlines()) if line.startswith("attnres conformance: backend")]
    assert len(titles) == 2
    lines = text.splitlines()
    for device, start in zip(("cpu", "cpu:1"), titles):
        listed = [r for r in report.results if r.device == device]
        cases = next(line for line in lines[start:] if line.startswith("cases: "))
        assert cases.startswith(f"cases: {len(listed)} listed: ")
        assert _numbers(cases) == dict(Counter(r.status for r in listed), **{
            s: 0 for s in ("pass", "fail", "skip", "xfail", "xpass", "gap") if s not in {r.status for r in listed}})
        checks = next(line for line in lines[start:] if line.startswith("checks "))
        assert f": {sum(len(r.cells) for r in listed)}: " in checks
        matrix = next(line for line in lines[start:] if line.startswith("matrix cells: "))
        header = next(i for i in range(start, len(lines)) if lines[i].startswith("row "))
        table = lines[header + 1:header + 1 + len(report.rows())]
        width = len(lines[header].split()) // 2  # "f64 fwd" is two words
        shown = Counter()
        for row in table:
            words = [w for w in row.split()[1:] if not re.fullmatch(r"[-+.e\d]+", w)]
            shown.update(words)
            shown["empty"] += width - len(words)
        assert _numbers(matrix) == {label: shown.get(label, 0) for label in MATRIX_LABELS}
        assert sum(_numbers(matrix).values()) == len(report.rows()) * width


def test_json_counts_match_the_results():
    report = run_conformance(TwoDevices(), case_ids=FEW)
    data = json.loads(report.to_json())
    assert sum(data["case_summary"].values()) == len(data["results"]) == 2 * len(FEW)
    assert sum(data["summary"].values()) == sum((r["forward"] is not None) + (r["gradient"] is not None)
                                                for r in data["results"])
    assert set(data["matrix"]) == {"cpu", "cpu:1"}


def test_implementations_used_counts_this_run_only():
    backend = Counting()
    report = run_conformance(backend, case_ids=[BASE, "depth_attention/weights/N5-T3-D16/float64"])
    assert report.implementations == {"fast": backend.used["fast"] - 7, "fallback": backend.used["fallback"] - 3}
    assert report.implementations["fast"] >= 1 and report.implementations["fallback"] >= 1
    assert "implementation that ran: fast (" in report.to_text()
    assert json.loads(report.to_json())["implementations_used"] == report.implementations
    plain = run_conformance(Plain(), case_ids=[BASE], spec="plain")
    assert plain.implementations is None and "not reported" in plain.to_text()
    raising = run_conformance(RaisingCount(), case_ids=[BASE])
    assert raising.implementations is None and not raising.failed
    assert any("implementations_used() raised RuntimeError" in w for w in raising.warnings)


def test_date_wall_time_and_commit():
    report = run_conformance(Counting(), case_ids=[BASE])  # defined in this file: tracked in the checkout
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", report.date)
    assert report.wall_time is not None and 0 < report.wall_time < 60
    assert re.fullmatch(r"[0-9a-f]{40}( \(uncommitted changes\))?", report.commit), report.commit
    assert f"commit {report.commit}" in report.to_text()


def test_commit_is_unknown_outside_a_checkout_or_without_git(tmp_path, monkeypatch):
    outside = tmp_path / "port.py"
    outside.write_text("backend = None\n")
    assert provenance.git_commit(outside) == "unknown"
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable at all
    assert provenance.git_commit(provenance.source_file(Counting())) == "unknown"


def test_commit_unknown_when_run_outside_a_checkout(tmp_path):
    """A backend module in a folder that is no checkout: the report says so, no crash."""
    (tmp_path / "outside_port.py").write_text(
        "from attnres_conformance.reference_backend import ReferenceBackend\n"
        "class Port(ReferenceBackend):\n    name = 'port'\nbackend = Port()\n")
    code = ("import outside_port; from attnres_conformance.runner import run_conformance; "
            f"print(run_conformance(outside_port.backend, case_ids=[{BASE!r}], spec='outside_port:backend').commit)")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "unknown"


def test_legend_and_document():
    reports = [run_conformance(adapters.reference, case_ids=[BASE]),
               run_conformance(adapters.broken_norm_weight_grad, case_ids=[BASE])]
    md = legend.document_markdown(reports, wall_time=1.5)
    assert md.startswith("# attnres conformance report\n")
    for needle in ("## Legend", "rel_err(a, r) = max_i", "| float32 | 2e-05 | 0.0001 |", "`pass*`", "`(empty)`",
                   "`xfail`", "`skip`", "wall time: 1.5 s in all", "date: ", "commit: ",
                   "| backend | verdict | cases | pass | fail | skip | xfail | gap | wall time | implementation that ran |",
                   "| numpy | PASS | 1 | 1 | 0 | 0 | 0 | 0 |",
                   "| adapters:broken_norm_weight_grad | FAIL | 1 | 0 | 1 | 0 | 0 | 0 |"):
        assert needle in md, needle
    data = legend.document_dict(reports, wall_time=1.5)
    assert data["schema_version"] == 1 and data["wall_time_s"] == 1.5 and data["spec_version"] == "0.1"
    assert data["legend"]["rtol"]["bfloat16"] == {"value": 8e-3, "gradient": 3e-2}
    assert set(data["legend"]["statuses"]) >= {"pass", "pass*", "skip", "xfail", "(empty)"}
    assert [r["backend"] for r in data["reports"]] == ["numpy", "broken_norm_weight_grad"]


def test_report_round_trips_through_json():
    report = run_conformance(adapters.broken_norm_weight_grad, case_ids=FEW)
    again = Report.from_dict(json.loads(report.to_json()))
    assert again.to_dict() == report.to_dict()
    assert again.to_text() == report.to_text()
