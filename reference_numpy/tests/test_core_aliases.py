"""The spec core moved from `attnres_numpy.<module>` to `attnres_core.<module>`; the old paths are
deprecated aliases for one release: the very same module object, and a DeprecationWarning that
names the new path.  Importing the oracle itself (`attnres_numpy`, its `ops`, `tape`, `model`,
`vectors`) warns about nothing: it imports the core by its new path."""

from __future__ import annotations

import importlib
import subprocess
import sys

import attnres_core
import attnres_numpy
import pytest

CORE = ("config", "validation", "numerics", "schedule", "probe", "training")


@pytest.mark.parametrize("name", CORE)
def test_old_path_is_the_same_module_and_warns(name):
    new = importlib.import_module(f"attnres_core.{name}")
    old_key = f"attnres_numpy.{name}"
    saved = sys.modules.pop(old_key, None)
    try:
        with pytest.warns(DeprecationWarning, match=rf"attnres_numpy\.{name} is deprecated: import attnres_core\.{name}"):
            old = importlib.import_module(old_key)
        assert old is new
        assert sys.modules[old_key] is new
    finally:
        if saved is not None:
            sys.modules[old_key] = saved
    # the name the alias binds on the package is the core module too
    assert getattr(attnres_numpy, name) is new


def test_warning_points_at_the_importing_line():
    code = ("import warnings\nwarnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    import attnres_numpy.config\n"
            "print(w[0].filename, w[0].lineno)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["<string>", "4"], out


def test_top_level_reexports_are_the_core_objects():
    from attnres_core import config, numerics, schedule, validation

    assert attnres_numpy.ResidualConfig is config.ResidualConfig
    assert attnres_numpy.VARIANT_KINDS is config.VARIANT_KINDS
    assert attnres_numpy.numerics is numerics
    assert attnres_numpy.schedule is schedule
    assert attnres_numpy.validation is validation
    assert sorted(attnres_core.__all__) == sorted(CORE + ("dispatch",))  # dispatch is new: no alias


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
