"""pytest plugin: `pytest --attnres-backend=NAME` runs the suite as one test per case.

    pytest --attnres-backend=torch                    # every case (test ids = case ids)
    pytest --attnres-backend=numpy --attnres-quick -k shapes
    pytest --attnres-backend=my_port.adapter:backend --attnres-skips=my-port-skips.txt

Cases outside the backend's capabilities or in the skips file are skipped (with the reason),
xfail lines become xfails (strict: a pass fails), and a failing test prints the case result
and its reproducer.  Without `--attnres-backend` the plugin adds nothing (it is installed as a
pytest11 entry point, so it must stay cheap: everything is imported lazily).
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("attnres", "attnres conformance suite")
    group.addoption("--attnres-backend", default=None, metavar="NAME|module:object",
                    help="run the attnres conformance cases against this backend")
    group.addoption("--attnres-dtype", action="append", default=None,
                    help="dtype(s) to check (default: all four; undeclared ones are skipped)")
    group.addoption("--attnres-device", action="append", default=None, help="device(s) to check")
    group.addoption("--attnres-quick", action="store_true", help="the reduced grid of --quick")
    group.addoption("--attnres-skips", default=None, metavar="FILE", help="the port's skips/xfails file")


class ConformanceFailure(Exception):
    """A failing case; its text is the case result plus the reproducer."""


class ConformanceItem(pytest.Item):
    def __init__(self, *, case, device, backend, spec, rule, caps, **kwargs):
        super().__init__(**kwargs)
        self.case, self.device, self.backend = case, device, backend
        self.spec, self.rule, self.caps = spec, rule, caps

    def runtest(self):
        from .runner import run_case

        result = run_case(self.backend, self.case, self.device, spec=self.spec, rule=self.rule, caps=self.caps)
        statuses = {c.status for c in result.cells}
        if result.failed:
            raise ConformanceFailure(f"{result.describe()}\n\nreproduce:\n{result.reproducer}")
        if statuses == {"skip"}:
            pytest.skip(result.forward.message)
        if "xfail" in statuses:
            pytest.xfail(result.forward.message)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformanceFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return "attnres-conformance", None, f"{self.case.id} [{self.spec}, {self.device}]"


def pytest_collection_modifyitems(session, config, items):
    spec = config.getoption("--attnres-backend")
    if not spec:
        return
    from .cases import generate
    from .numerics import DTYPES
    from .registry import load_backend
    from .runner import load_skips, match_rule

    backend = load_backend(spec)
    if not backend.is_available():
        raise pytest.UsageError(f"--attnres-backend={spec}: is_available() is False here")
    caps = backend.capabilities()
    rules = load_skips(config.getoption("--attnres-skips")) if config.getoption("--attnres-skips") else []
    devices = config.getoption("--attnres-device") or list(caps.devices)
    cases = generate(dtypes=config.getoption("--attnres-dtype") or DTYPES,
                     quick=config.getoption("--attnres-quick"), caps=caps)
    used = set()
    for device in devices:
        for case in cases:
            rule = match_rule(rules, case)
            used.add(rule)
            name = case.id if len(devices) == 1 else f"{case.id}[{device}]"
            items.append(ConformanceItem.from_parent(session, name=name, nodeid=f"attnres::{name}", case=case,
                                                     device=device, backend=backend, spec=spec, rule=rule,
                                                     caps=caps))
    for r in rules:
        if r not in used:
            config.issue_config_time_warning(
                pytest.PytestWarning(f"attnres skips line {r.line}: {r.prefix!r} matches no case"), stacklevel=2)
