"""The boundary between the spec core (`attnres_core`) and the float64 oracle (`attnres_numpy`):
the oracle re-exports the core's objects (the same ones), importing either warns about nothing,
and the core never imports the oracle."""

from __future__ import annotations

import subprocess
import sys

import attnres_core
import attnres_numpy

CORE = ("config", "validation", "numerics", "schedule", "probe", "training", "dispatch")


def test_top_level_reexports_are_the_core_objects():
    from attnres_core import config, numerics, schedule, validation

    assert attnres_numpy.ResidualConfig is config.ResidualConfig
    assert attnres_numpy.VARIANT_KINDS is config.VARIANT_KINDS
    assert attnres_numpy.numerics is numerics
    assert attnres_numpy.schedule is schedule
    assert attnres_numpy.validation is validation
    assert sorted(attnres_core.__all__) == sorted(CORE)


def test_importing_the_oracle_does_not_warn():
    code = ("import attnres_numpy, attnres_numpy.ops, attnres_numpy.tape, attnres_numpy.model, "
            "attnres_numpy.vectors\n"
            "import attnres_core.config, attnres_core.validation, attnres_core.numerics, "
            "attnres_core.schedule, attnres_core.probe, attnres_core.training\n")
    subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], check=True)


def test_the_core_does_not_import_the_oracle():
    code = ("import sys\nimport attnres_core.config, attnres_core.validation, attnres_core.numerics, "
            "attnres_core.schedule, attnres_core.probe, attnres_core.training\n"
            "print(sorted(m for m in sys.modules if m.startswith('attnres')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "attnres_numpy" not in out, out
