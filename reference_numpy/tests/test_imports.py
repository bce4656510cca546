"""The base packages (core, oracle, suite) import numpy only: importing them loads no framework."""

from __future__ import annotations

import json
import subprocess
import sys

FRAMEWORKS = ("torch", "jax", "jaxlib", "flax", "mlx", "triton", "tensorflow")
#: The suite's per-framework adapters, ours and the public ports' (`ports/`), import their framework
#: by design; the registry imports one only when that backend is chosen (checked below: every other
#: module, `ports.compliance` included, loads without a framework).
FRAMEWORK_ADAPTERS = (tuple(f"attnres_conformance.adapters.{name}" for name in ("torch", "jax", "mlx"))
                      + tuple(f"attnres_conformance.ports.attnres_{name}" for name in ("torch", "jax", "mlx"))
                      + tuple(f"attnres_conformance.ports.{name}"
                              for name in ("fla", "attn_res", "liger", "mlx_lm_k3")))

SCRIPT = """
import importlib, json, pkgutil, sys
import attnres_core, attnres_numpy, attnres_conformance
loaded = []
for pkg in (attnres_core, attnres_numpy, attnres_conformance):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if info.name in %r:  # a framework's adapter: imported by name, only when chosen
            continue
        importlib.import_module(info.name)
        loaded.append(info.name)
print(json.dumps({"modules": loaded, "frameworks": sorted(
    m for m in sys.modules if m.split(".")[0] in %r)}))
""" % (FRAMEWORK_ADAPTERS, FRAMEWORKS)


def test_base_packages_load_no_framework():
    """Imports attnres_core, attnres_numpy, attnres_conformance and every submodule of each in a fresh
    interpreter, then checks sys.modules.  (A module that imported a framework fails here in
    either case: with the framework installed it shows up in sys.modules, without it the import
    raises.)"""
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"attnres_core.schedule", "attnres_numpy.model"} <= set(report["modules"])
    assert {"attnres_conformance.adapters.base", "attnres_conformance.adapters.numpy",
            "attnres_conformance.registry", "attnres_conformance.ports.compliance"} <= set(report["modules"])
    assert report["frameworks"] == [], f"frameworks loaded: {report['frameworks']}"
