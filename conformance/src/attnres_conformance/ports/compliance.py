"""The compliance table of public ports (docs/ports.md): run the suite on each pinned release,
check each verdict against the one expected, and write or check the table from the JSON reports.

    nox -s ports                     # install the pins, run, check the verdicts and docs/ports.md
    nox -s ports -- --write          # the same, rewriting docs/ports.md from this run
    python -m attnres_conformance.ports.compliance --reports DIR [--table docs/ports.md] [--write]
    python -m attnres_conformance.ports.compliance --reports DIR --render-only   # no run: the table

Every port runs in its own process (`attnres-conformance --backend ... --json`), two at a time.
The releases installed in the running environment must be the pinned ones (`PORTS`); a second
release of the same distribution (Liger-kernel 0.8.3 beside 0.8.4) is installed without
dependencies into a folder of its own under the virtualenv and put first on PYTHONPATH for its
run.  The expected verdicts are part of the check: a port whose verdict or set of failing spec
rules changes fails the run (a changed suite or a new release: update `PORTS` and the table in
the same commit).  The table is rendered from the reports only: nothing in it is written by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..coverage import coverage_text
from ..rules import hint, rule_of
from ..runner import Report, parse_skips


@dataclass(frozen=True)
class Port:
    """One row of the table: a pinned release, its adapter, how it runs, what it must give."""

    key: str  # the report's file name
    title: str
    package: str
    version: str
    module: str  # attnres_conformance.ports.<module>: its `backend` and `SKIPS`
    expect_verdict: str
    #: Spec rules (`rules.rule_of(row)[0]`) that must be among the failing cases' rules: the
    #: defects the table documents.  (The whole set, and every count, is pinned by the table.)
    expect_rules: frozenset
    #: Spec rules that must not fail (the fix a release is known for).
    forbid_rules: frozenset = frozenset()
    #: Spec rules whose cases fail or pass from run to run, with the reason: listed with it in the
    #: table whatever this run gave, and left out of the checks and counts.
    unstable: Tuple[Tuple[str, str], ...] = ()
    options: Tuple[str, ...] = ()  # attnres-conformance options beyond --backend/--skips/--json
    #: Installed without dependencies into its own folder (a second release beside the
    #: environment's); False: the environment's own installation must be this release.
    separate: bool = False
    #: What the run covers when it is not the whole suite, and why.
    scope: str = "the whole suite, every declared dtype"
    home: str = ""

    @property
    def backend(self) -> str:
        return f"attnres_conformance.ports.{self.module}:backend"

    @property
    def install(self) -> str:
        extra = {"fla": " fla-core==0.6.0 triton", "liger": " triton packaging",
                 "mlx_lm_k3": ' "mlx[cpu]"'}.get(self.module, "")
        return f"pip install {self.package}=={self.version}{extra}"


LIGER_SCOPE = ("`--quick` in float32 and float16 under `TRITON_INTERPRET=1` (interpreted kernels take "
               "seconds a call at N = 33 and 130; bfloat16 is not declared on CPU: the interpreter's bf16 "
               "arithmetic on CPUs is wrong). The quick grid keeps every core family: N = 33 and 130, "
               "magnitudes, non-finite inputs, gradients; on CUDA run the whole suite.")
PORTS: List[Port] = [
    Port("fla-0.6.0", "FLA `naive_attnres`", "flash-linear-attention", "0.6.0", "fla", "FAIL",
         frozenset({"C10.6", "C17"}), forbid_rules=frozenset({"C1, C16", "C1, C2, C16"}), home="https://github.com/fla-org/flash-linear-attention"),
    Port("attn-res-0.1.0", "attn-res `AttnResOperator`", "attn-res", "0.1.0", "attn_res", "FAIL",
         frozenset({"2.1", "C10.6"}), home="https://pypi.org/project/attn-res/"),
    Port("liger-kernel-0.8.3", "Liger-kernel `LigerAttnResFunction`", "liger-kernel", "0.8.3", "liger", "FAIL",
         frozenset({"C1, C16", "C1, C2, C16"}),
         unstable=(("C15", "the gradients of the dropped sources are uninitialized memory (torch.empty_like), so "
                           "two runs may differ: the determinism case fails or passes by chance"),),
         options=("--quick", "--dtype", "float32", "--dtype", "float16"),
         separate=True, scope=LIGER_SCOPE, home="https://github.com/linkedin/Liger-Kernel"),
    # 0.8.4 fixed the drop; 0.8.5 ships the same attn_res kernel.  Both keep the two deviations
    # the adapter's SKIPS declares (C10.2, C10.6): their verdict says so.
    *(Port(f"liger-kernel-{version}", "Liger-kernel `LigerAttnResFunction`", "liger-kernel", version, "liger",
           "PASS with 4 declared expected failures", frozenset(),
           forbid_rules=frozenset({"C1, C16", "C1, C2, C16"}), options=("--quick", "--dtype", "float32", "--dtype", "float16"),
           separate=separate, scope=LIGER_SCOPE, home="https://github.com/linkedin/Liger-Kernel")
      for version, separate in (("0.8.4", True), ("0.8.5", False))),
    Port("mlx-lm-0.32.2", "mlx-lm Kimi K3 `_attn_res_mix`", "mlx-lm", "0.32.2", "mlx_lm_k3", "FAIL",
         frozenset({"C1, C2, C16", "C10.6"}), forbid_rules=frozenset({"C1, C16"}),
         scope="the whole suite, every declared dtype, on MLX's CPU (the compiled combine; the Metal kernel "
               "serves inference on Apple GPUs only)", home="https://github.com/ml-explore/mlx-lm"),
]
#: Ports whose verdicts must differ on one rule: the regression the table exists to show.
CONTRAST = ("liger-kernel-0.8.3", "liger-kernel-0.8.4", "C1, C16")


def _adapter(port: Port):
    import importlib

    return importlib.import_module(f"attnres_conformance.ports.{port.module}")


def skips_of(port: Port) -> str:
    """The port's skips file (its adapter module's `SKIPS`): design choices no capability names."""
    return getattr(_adapter(port), "SKIPS", "")


# -- running ------------------------------------------------------------------------------------
def separate_site(port: Port) -> Path:
    return Path(sys.prefix, "attnres-ports", f"{port.package}-{port.version}")


def install_separate(port: Port) -> None:
    """`pip install --no-deps --target` the release into its own folder (once)."""
    site = separate_site(port)
    if (site / f"{port.package.replace('-', '_')}-{port.version}.dist-info").is_dir():
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                    f"{port.package}=={port.version}"], check=True)


def check_installed(port: Port) -> Optional[str]:
    """Why the environment's release of the port is not the pinned one (None when it is)."""
    try:
        found = metadata.version(port.package)
    except metadata.PackageNotFoundError:
        return f"{port.package} is not installed ({port.install})"
    return None if found == port.version else f"{port.package} {found} installed, {port.version} pinned"


def command(port: Port, json_path: Path, skips_path: Path) -> List[str]:
    return [sys.executable, "-m", "attnres_conformance", "--backend", port.backend, "--skips", str(skips_path),
            *port.options, "--json", str(json_path), "--no-progress"]


def run_ports(ports: Sequence[Port], reports: Path, jobs: int = 2) -> Dict[str, float]:
    """Run each port into reports/<key>.json, `jobs` at a time; returns the wall time of each."""
    reports.mkdir(parents=True, exist_ok=True)
    skips_dir = Path(tempfile.mkdtemp(prefix="attnres-ports-"))
    # The interpreted Triton runs are the longest: first, so the others fill the second slot.
    pending, running, walls = sorted(ports, key=lambda q: q.module != "liger"), [], {}
    while pending or running:
        while pending and len(running) < jobs:
            port = pending.pop(0)
            module = _adapter(port)
            skips = skips_dir / f"{port.key}.txt"
            skips.write_text(skips_of(port))
            env = dict(os.environ, OMP_NUM_THREADS="1", **module.backend.environment())
            if port.separate:
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(separate_site(port)), env.get("PYTHONPATH")]))
            log = open(reports / f"{port.key}.txt", "w")
            print(f"ports: {port.key}: {' '.join(command(port, reports / f'{port.key}.json', skips))}", flush=True)
            proc = subprocess.Popen(command(port, reports / f"{port.key}.json", skips), stdout=log,
                                    stderr=subprocess.STDOUT, env=env)
            running.append((port, proc, log, time.monotonic()))
        time.sleep(0.2)
        for item in list(running):
            port, proc, log, start = item
            if proc.poll() is not None:
                log.close()
                walls[port.key] = time.monotonic() - start
                print(f"ports: {port.key}: exit {proc.returncode} in {walls[port.key]:.0f} s", flush=True)
                running.remove(item)
    return walls


# -- reading the reports ------------------------------------------------------------------------
def load_report(path: Path) -> Report:
    data = json.loads(path.read_text())
    (report,) = data["reports"]
    return Report.from_dict(report)


def failing_rules(report: Report, port: Optional[Port] = None) -> Dict[str, List]:
    """{spec rule: [failing results]} (validation gaps are not failures; less the port's unstable rules)."""
    unstable = {rule for rule, _ in port.unstable} if port is not None else set()
    out: Dict[str, List] = {}
    for r in report.results:
        rule = (rule_of(r.row) or ("unnamed",))[0]
        if r.failed and rule not in unstable:
            out.setdefault(rule, []).append(r)
    return dict(sorted(out.items()))


def _failed_cells(results) -> list:
    """(error, dtype) of the failing forward cells with an error size, or of the failing gradient
    cells when no forward cell has one: a forward error is the finding, and gradients next to a
    wrong forward may be whatever the port left in memory."""
    for column in ("forward", "gradient"):
        cells = [(getattr(r, column).err, r.dtype) for r in results if getattr(r, column) is not None
                 and getattr(r, column).status == "fail" and getattr(r, column).err]
        if cells:
            return cells
    return []


def categories(results) -> str:
    return ", ".join(sorted({r.category for r in results if r.category}))


def contract_example(results) -> str:
    """The first message of a failing non-numerical case (those hold no figures that could vary)."""
    for r in results:
        if r.category in ("result contract", "error contract", "crash"):
            message = next(c.message for c in r.cells if c.status == "fail")
            return f"; e.g. `{r.id}`: {message.split(' at /')[0][:160]}"
    return ""


def worst(results) -> Optional[float]:
    errs = [err for err, _ in _failed_cells(results)]
    return max(errs) if errs else None


def worst_hint(results) -> str:
    """What the size of the worst finite error suggests (`rules.hint`), with its dtype."""
    pairs = [(err, dtype) for err, dtype in _failed_cells(results) if err != float("inf")]
    if not pairs:
        return ""
    err, dtype = max(pairs)
    found = hint(dtype, err)
    return f" ({dtype} {_e(err)}: {found})" if found else ""


def expectation_errors(port: Port, report: Report) -> List[str]:
    problems = []
    if report.versions.get(port.package) != port.version:
        problems.append(f"{port.key}: ran {port.package} {report.versions.get(port.package)}, pinned {port.version}")
    if report.verdict() != port.expect_verdict:
        problems.append(f"{port.key}: verdict {report.verdict()}, expected {port.expect_verdict}")
    rules = set(failing_rules(report, port))
    if not port.expect_rules <= rules:
        problems.append(f"{port.key}: expected failures of {sorted(port.expect_rules - rules)} are gone "
                        f"(failing rules: {sorted(rules)})")
    if rules & port.forbid_rules:
        problems.append(f"{port.key}: fails {sorted(rules & port.forbid_rules)}, which this release does not break")
    return problems


def contrast_errors(reports: Dict[str, Report]) -> List[str]:
    bad, good, rule = CONTRAST
    if bad not in reports or good not in reports:
        return []
    problems = []
    if rule not in failing_rules(reports[bad]):
        problems.append(f"{bad} must fail {rule} (every source past 32 dropped)")
    if rule in failing_rules(reports[good]):
        problems.append(f"{good} must not fail {rule}")
    return problems


# -- the table ----------------------------------------------------------------------------------
def _e(x: Optional[float]) -> str:
    return "-" if x is None else "inf" if x == float("inf") else f"{x:.0e}"


def design_choices(port: Port, report: Report) -> List[str]:
    caps, out = report.capabilities, []
    out.append("dtypes " + ", ".join(caps["dtypes"]))
    out.append("ops " + ", ".join(caps["ops"]))
    out.append("options " + (", ".join(caps["options"]) or "none"))
    if tuple(caps.get("out_norm_outputs", ())) == ("out_normed",):
        out.append("fused norm returns out_normed only")
    for key, label in (("gain", "no gain"), ("backward", "forward only"), ("merge_lse", "merge without lse")):
        if caps.get(key) is False:
            out.append(label)
    for key in ("scale", "eps", "max_sources", "max_dim", "dim_multiple"):
        if caps.get(key) is not None:
            out.append(f"{key} {caps[key]}")
    if caps.get("dim_power_of_two"):
        out.append("D a power of two")
    if caps.get("validates_inputs") is False:
        out.append("no argument checks")
    if report.environment:
        out.append("env " + " ".join(f"{k}={v}" for k, v in sorted(report.environment.items())))
    for rule in parse_skips(skips_of(port), f"{port.module}.SKIPS"):
        label = "expected failure" if rule.mode == "xfail" else "skips"
        out.append(f"{label} `{rule.prefix}` ({rule.reason})")
    return out


def render(reports: Dict[str, Report]) -> str:
    lines = [
        "# Public ports: compliance table",
        "",
        "<!-- Generated by `nox -s ports` (attnres_conformance.ports.compliance) from the JSON reports of",
        "     its run; `nox -s ports -- --write` rewrites it. Do not edit by hand: CI checks that it matches. -->",
        "",
        "Other projects' implementations of Attention Residuals, each installed from its pinned PyPI",
        "release and checked by `attnres-conformance` through the adapter named in the table",
        "([validating a port](validating-a-port.md) explains adapters, declared design choices and the",
        "coverage line). CI (`nox -t tests`) runs them all and fails when a verdict, a defect the table",
        "documents, or anything else in this page changes. A port fails on any spec rule it breaks in a",
        "declared dtype; the rules and their reasons are listed per port below. The every-port rows run",
        "N = 33 and 130 whatever a port declares: they tell Liger-kernel 0.8.3, which drops every source",
        "past 32, from 0.8.4 and 0.8.5, which fixed that. A deviation a port owns is declared in its",
        "adapter's skips file as an expected failure (an `xfail` line with the rule and the reason): the",
        "case still runs, a case that starts passing is an error, and the verdict counts them (Liger",
        "declares two: C10.6 at |x| >= 1e15 in float32, and the key rounded to float16 in a float16 call).",
        "",
        "| port | release | adapter | verdict | N = 33 / 130 rows | spec rules failed (cases, worst rel. error) | validation gaps |",
        "|---|---|---|---|---|---|---|",
    ]
    for port in PORTS:
        report = reports.get(port.key)
        if report is None:
            lines.append(f"| {port.title} | {port.version} | `{port.backend}` | not run | | | |")
            continue
        rules = failing_rules(report, port)
        every = [r for r in report.results if r.row.endswith("/sources_past_32") and r.status != "skip"]
        every_text = ("FAIL, off by " + _e(worst(every))) if any(r.failed for r in every) else \
            "pass, within " + _e(max((c.err for r in every for c in r.cells if c.err is not None), default=None))
        failed = "; ".join([f"{rule} ({len(rs)}, {_e(worst(rs))})" for rule, rs in rules.items()]
                           + [f"{rule} (unstable)" for rule, _ in port.unstable]) or "none"
        declared = report.case_summary()["xfail"]
        failed += f"; declared expected failures: {declared}" if declared else ""
        gaps = sum(1 for r in report.results if r.status == "gap")
        lines.append(f"| [{port.title}]({port.home}) | {port.package} {port.version} | `{port.module}` | "
                     f"**{report.verdict()}** | {every_text} | {failed} | {gaps} |")
    lines += ["", "## Each port", ""]
    for port in PORTS:
        report = reports.get(port.key)
        if report is None:
            continue
        lines += [f"### {port.title} {port.version}", "",
                  f"- install: `{port.install}`",
                  f"- run: `{env_text(port)}attnres-conformance --backend {port.backend}"
                  + "".join(f" {o}" for o in port.options)
                  + (f" --skips {port.module}-skips.txt` (the adapter's `SKIPS`, listed below: "
                     f"`python -m attnres_conformance.ports.{port.module} > {port.module}-skips.txt`)"
                     if skips_of(port) else "`"),
                  f"- scope: {port.scope}",
                  f"- verdict: **{report.verdict()}**",
                  f"- coverage (cases run / cases in declared dtypes): "
                  f"{coverage_text(report.results, report.capabilities)}",
                  "- declared design choices: " + "; ".join(design_choices(port, report))]
        rules = failing_rules(report, port)
        if rules or port.unstable:
            lines.append("- defects found, by the spec rule each breaks:")
            for rule, rs in rules.items():
                why = rule_of(rs[0].row)[1] if rule_of(rs[0].row) else ""
                dtypes = sorted({r.dtype for r in rs}, key=["float64", "float32", "float16", "bfloat16"].index)
                rows = sorted({r.row.split("/", 1)[-1] for r in rs})
                lines.append(f"    - **{rule}** ({why}): {len(rs)} case{'s' * (len(rs) != 1)} "
                             f"({categories(rs)}) in {', '.join(dtypes)}, worst relative error "
                             f"{_e(worst(rs))}{worst_hint(rs)}; rows " + ", ".join(f"`{row}`" for row in rows)
                             + contract_example(rs))
            for rule, why in port.unstable:
                lines.append(f"    - **{rule}**, unstable: {why}")
        gaps = sorted({r.id.split("/")[2] for r in report.results if r.status == "gap"})
        if gaps:
            lines.append("- validation gaps (spec errors the port does not raise as the spec's ValueError / "
                         "TypeError naming the argument; not failures): " + ", ".join(f"`{g}`" for g in gaps))
        lines.append("")
    return "\n".join(lines)


def table_problem(table: Path, reports: Dict[str, Report], write: bool = False) -> Optional[str]:
    """Why `table` is not this run's table (None when it is; with `write` it is rewritten)."""
    missing = [p.key for p in PORTS if p.key not in reports]
    if missing:
        return f"{table}: not checked, no report of {', '.join(missing)}"
    text = render(reports)
    if write:
        table.write_text(text)
        return None
    if not table.is_file() or table.read_text() != text:
        return (f"{table} differs from this run's table: rewrite it with `nox -s ports -- --write` (or "
                f"`python -m attnres_conformance.ports.compliance --reports DIR --render-only --table {table} "
                f"--write`) and commit it")
    return None


def env_text(port: Port) -> str:
    """The environment its runs need, as a command-line prefix (Liger on CPU: TRITON_INTERPRET=1)."""
    return "TRITON_INTERPRET=1 " if port.module == "liger" else ""


def load_all(reports: Path) -> Dict[str, Report]:
    return {p.key: load_report(reports / f"{p.key}.json") for p in PORTS if (reports / f"{p.key}.json").is_file()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnres_conformance.ports.compliance",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--reports", type=Path, required=True, help="folder of the JSON reports (written by the run)")
    p.add_argument("--table", type=Path, help="the table (docs/ports.md): checked, or with --write rewritten")
    p.add_argument("--write", action="store_true", help="rewrite --table instead of checking it")
    p.add_argument("--render-only", action="store_true", help="no run: the table from the reports in --reports")
    p.add_argument("--port", action="append", default=[], help="run only this port key (repeatable)")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    ports = [q for q in PORTS if not args.port or q.key in args.port]
    unknown = set(args.port) - {q.key for q in PORTS}
    if unknown:
        p.error(f"unknown port {sorted(unknown)}; choose from {[q.key for q in PORTS]}")
    problems = []
    if not args.render_only:
        for port in ports:
            if port.separate:
                install_separate(port)
            else:
                why = check_installed(port)
                if why:
                    problems.append(why)
        if problems:
            print("ports: " + "\n".join(problems), file=sys.stderr)
            return 1
        start = time.monotonic()
        run_ports(ports, args.reports, args.jobs)
        print(f"ports: {len(ports)} ports in {time.monotonic() - start:.0f} s", flush=True)
    reports = load_all(args.reports)
    for port in ports:
        if port.key not in reports:
            problems.append(f"{port.key}: no report (see {args.reports / (port.key + '.txt')})")
            continue
        report = reports[port.key]
        print(f"ports: {port.key}: {report.verdict()}; failing rules {sorted(failing_rules(report))}", flush=True)
        problems += expectation_errors(port, report)
    problems += contrast_errors(reports)
    if args.table is not None:
        problem = table_problem(args.table, reports, args.write)
        if problem:
            problems.append(problem)
        elif args.write:
            print(f"ports: wrote {args.table}")
    for line in problems:
        print(f"ports: FAILED: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
