"""One session per backend, each in its own virtualenv (reused between runs).

    nox -t tests            # every test session: the README's test command (CI runs exactly this)
    nox -s conformance      # the main job: conformance report over every backend -> reports/
    nox -s conformance -- torch jax    # only some backends
    nox -s vectors          # regenerate spec/vectors from their case definitions
    nox -s lint
"""

from __future__ import annotations

import os

import nox

nox.needs_version = ">=2024.10.9"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests-numpy", "tests-torch", "tests-jax", "tests-mlx"]

#: torch is pinned: this machine (and CI) has the 2.13.0 CPU wheel on disk; an unpinned torch
#: would pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"
TRITON = "triton>=3.0"
JAX = "jax[cpu]>=0.4.35"
FLAX = "flax>=0.10"
MLX = "mlx[cpu]>=0.25"
TEST_DEPS = ("pytest>=8", "hypothesis>=6.100")
BASE = ("-e", "reference_numpy", "-e", "conformance")

BACKEND_INSTALL = {
    "numpy": (),
    "torch": (TORCH, TRITON, "-e", "backend_torch[triton,plots]"),
    "jax": (JAX, FLAX, "-e", "backend_jax[flax]"),
    "mlx": (MLX, "-e", "backend_mlx"),
}
BACKEND_TESTS = {
    "numpy": ("reference_numpy/tests", "conformance/tests"),
    "torch": ("backend_torch/tests",),
    "jax": ("backend_jax/tests",),
    "mlx": ("backend_mlx/tests",),
}


def _install(session: nox.Session, *backends: str) -> None:
    # Frameworks first, with their pins, so the editable installs find them satisfied.
    extra = [arg for b in backends for arg in BACKEND_INSTALL[b]]
    session.install(*TEST_DEPS, *BASE, *extra)


def _tests(session: nox.Session, backend: str) -> None:
    _install(session, backend)
    session.run("pytest", *BACKEND_TESTS[backend], *session.posargs)
    # The conformance suite against this backend (the same checks `nox -s conformance` reports).
    dtypes = ("--dtype", "float64") if backend == "numpy" else ()  # the reference is float64-only
    session.run("attnres-conformance", "--backend", backend, *dtypes)
    if backend == "torch":  # again on the chunked torch kernel, the fallback without a C compiler
        session.run("attnres-conformance", "--backend", backend, env={"ATTNRES_TORCH_CPU_C": "0"})


@nox.session(name="tests-numpy", tags=["tests"])
def tests_numpy(session: nox.Session) -> None:
    """The reference, its finite-difference checks, golden-vector drift, and the suite's meta-tests."""
    _tests(session, "numpy")


@nox.session(name="tests-torch", tags=["tests"])
def tests_torch(session: nox.Session) -> None:
    """PyTorch ops, modules, custom-op/compile tests, Triton kernels under TRITON_INTERPRET=1."""
    _tests(session, "torch")


@nox.session(name="tests-jax", tags=["tests"])
def tests_jax(session: nox.Session) -> None:
    """JAX ops, NNX modules, sharding on 8 host devices, Pallas kernels in interpret mode."""
    _tests(session, "jax")


@nox.session(name="tests-mlx", tags=["tests"])
def tests_mlx(session: nox.Session) -> None:
    """MLX ops and modules on CPU (mlx[cpu]); Metal tests are skipped off Apple silicon."""
    _tests(session, "mlx")


@nox.session(name="conformance")
def conformance(session: nox.Session) -> None:
    """The main job: the conformance report over every backend (or those named in posargs)."""
    backends = session.posargs or ["numpy", "torch", "jax", "mlx"]
    _install(session, *backends)
    os.makedirs("reports", exist_ok=True)
    args = [a for b in backends for a in ("--backend", b)]
    session.run("attnres-conformance", *args, "--json", "reports/conformance.json",
                "--markdown", "reports/conformance.md")


@nox.session(name="vectors")
def vectors(session: nox.Session) -> None:
    """Regenerate spec/vectors/ (manifest.json + one .npz per case) from the case definitions."""
    _install(session, "numpy")
    session.run("python", "-m", "attnres_numpy.vectors", "spec/vectors", *session.posargs)


@nox.session(name="lint")
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
