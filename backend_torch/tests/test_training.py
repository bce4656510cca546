"""Training tools (`attnres_torch.training`): the stability schedules' values, exact end points and
argument errors; the monitor and converters it re-exports."""

from __future__ import annotations

import math

import pytest
from attnres_torch.training import CosineWarmup, LinearWarmup, TemperatureSchedule


def test_linear_warmup_values():
    a = LinearWarmup(4)
    assert [a(s) for s in range(7)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert LinearWarmup(0)(0) == 1.0 and LinearWarmup(0)(5) == 1.0  # no introduction


def test_cosine_warmup_values():
    a = CosineWarmup(4)
    got = [a(s) for s in range(6)]
    want = [0.0, (1 - math.cos(math.pi / 4)) / 2, 0.5, (1 - math.cos(3 * math.pi / 4)) / 2, 1.0, 1.0]
    assert got[0] == 0.0 and got[4] == 1.0 and got[5] == 1.0  # exact ends
    assert got == pytest.approx(want, abs=1e-15)
    assert got[1] == pytest.approx(0.1464466094067262, abs=1e-15)
    assert all(x < y for x, y in zip(got[:4], got[1:5]))  # strictly increasing inside


@pytest.mark.parametrize("kind,mid", [("linear", 2.5), ("cosine", 2.5), ("geometric", 2.0)])
def test_temperature_schedule_values(kind, mid):
    t = TemperatureSchedule(1.0, 4.0, 10, kind)
    assert t(0) == 1.0 and t(10) == 4.0 and t(11) == 4.0  # exact ends
    assert t(5) == pytest.approx(mid, rel=1e-15)


def test_temperature_schedule_quarter_points():
    assert TemperatureSchedule(0.25, 1.0, 4, "linear")(1) == pytest.approx(0.4375, rel=1e-15)
    cos = TemperatureSchedule(0.25, 1.0, 4, "cosine")(1)
    assert cos == pytest.approx(0.25 + 0.75 * (1 - math.cos(math.pi / 4)) / 2, rel=1e-15)
    assert TemperatureSchedule(0.25, 1.0, 4, "geometric")(1) == pytest.approx(0.25 * 4 ** 0.25, rel=1e-15)
    assert TemperatureSchedule(2.0, 0.5, 0)(0) == 0.5  # steps = 0: the end value at once


def test_parse():
    t = TemperatureSchedule.parse("0.25:1:200:cosine")
    assert (t.start, t.end, t.steps, t.kind) == (0.25, 1.0, 200, "cosine")
    assert TemperatureSchedule.parse("2:1:10").kind == "linear"
    for bad in ("1:2", "a:1:3", "1:2:3:4:5", "1:2:3.5"):
        with pytest.raises(ValueError, match="START:END:STEPS"):
            TemperatureSchedule.parse(bad)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="steps: expected an int >= 0"):
        LinearWarmup(-1)
    with pytest.raises(ValueError, match="steps"):
        CosineWarmup(2.5)
    with pytest.raises(ValueError, match="step: expected an int >= 0"):
        LinearWarmup(3)(-1)
    with pytest.raises(ValueError, match="step: expected"):
        CosineWarmup(3)(True)
    with pytest.raises(ValueError, match="start: expected a finite"):
        TemperatureSchedule(float("nan"), 1.0, 3)
    with pytest.raises(ValueError, match="end: expected a finite"):
        TemperatureSchedule(1.0, float("inf"), 3)
    with pytest.raises(ValueError, match="kind: expected one of linear, cosine, geometric"):
        TemperatureSchedule(1.0, 2.0, 3, "step")
    with pytest.raises(ValueError, match="kind='geometric' needs start > 0"):
        TemperatureSchedule(0.0, 2.0, 3, "geometric")


def test_training_gathers_the_tools_of_diagnostics_and_checkpoints():
    from attnres_torch import checkpoints, diagnostics, training

    for name in ("DepthMonitor", "LogPolicy", "RaisePolicy", "LrScalePolicy", "ResetPolicy",
                 "collapse_policy", "POLICIES", "entry_scalars", "write_entry"):
        assert getattr(training, name) is getattr(diagnostics, name), name
    for name in ("fla_config", "k3_config", "from_fla", "to_fla", "from_k3", "to_k3", "load_into"):
        assert getattr(training, name) is getattr(checkpoints, name), name
    assert all(hasattr(training, name) for name in training.__all__)
