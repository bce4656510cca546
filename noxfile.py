"""One session per backend, each in its own virtualenv (reused between runs).

    nox -t tests            # every test session: the README's test command (CI runs exactly this)
    nox -s conformance      # the main job: conformance report over every backend -> reports/conformance.md
    nox -s conformance -- torch jax    # only some backends -> reports/conformance-torch-jax.md
    nox -s conformance -- torch --quick   # options for attnres-conformance after the names
    nox -s vectors          # regenerate the golden vectors (spec/vectors) from their definitions
    nox -s lint
    nox -s docs             # the documentation site, mkdocs build --strict (also tagged "tests")

A reused virtualenv is not reinstalled when nothing it was installed from changed (the install
arguments and the distributions' pyproject.toml files; the packages are editable installs, so
source edits need no reinstall): `nox --no-reuse-existing-virtualenvs ...` rebuilds one from scratch.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import nox
import nox.logger

nox.needs_version = ">=2024.10.9"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests-numpy", "tests-torch", "tests-jax", "tests-mlx"]

#: torch is pinned: this machine (and CI) has the 2.13.0 CPU wheel on disk; an unpinned torch
#: would pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"
#: Triton kernels run on CUDA only; tests-torch installs Triton to run them under TRITON_INTERPRET=1.
TRITON = "triton>=3.0"
JAX = "jax[cpu]>=0.4.35"
FLAX = "flax>=0.10"
MLX = "mlx[cpu]>=0.25"
#: mlx-lm's models (Kimi K3, Llama) that attnres_mlx.mlx_lm converts: the newest release that
#: installs with mlx 0.32 (it brings transformers, not torch).
MLX_LM = "mlx-lm==0.32.2"
TEST_DEPS = ("pytest>=8", "hypothesis>=6.100")
#: Parallel pytest workers, one per core (at most 4), in every test session.
XDIST = "pytest-xdist>=3.6"
#: The Hugging Face stack tests-torch converts and trains (tiny configs, random weights, nothing
#: downloaded): pinned, so a new release cannot change what CI checks without a commit.
HF_STACK = ("transformers==5.24.0", "accelerate==1.15.0", "peft==0.21.2")
BASE = ("-e", "core", "-e", "reference_numpy", "-e", "conformance")
DISTRIBUTIONS = ("core", "reference_numpy", "conformance", "backend_torch", "backend_jax", "backend_mlx")
#: The golden vectors: package data of the suite (its wheel ships them); spec/vectors links here.
GOLDEN = "conformance/src/attnres_conformance/golden"

BACKEND_INSTALL = {
    "numpy": (),
    "torch": (TORCH, *HF_STACK, "-e", "backend_torch[plots]"),
    "jax": (JAX, FLAX, "orbax-checkpoint>=0.11", "-e", "backend_jax[flax]"),
    "mlx": (MLX, MLX_LM, "-e", "backend_mlx"),
}
#: XLA:CPU's fast-compile options (LLVM -O0, the loop emitters, one codegen module: the suite's JAX
#: adapter compiles with the same, attnres_conformance.adapters.jax.FAST_COMPILE), in XLA_FLAGS for
#: backend_jax's tests but those marked `xla_default_compile` (the op's rounding, which run in a
#: pytest of their own with XLA's defaults).  The HLO passes still run: the others check the same
#: programs' results, compiled ~3x faster (measured on 2 cores: 668 s -> 242 s for the whole folder).
JAX_FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                    "--xla_cpu_parallel_codegen_split_count=1")
BACKEND_TESTS = {
    "numpy": ("core/tests", "reference_numpy/tests", "conformance/tests"),
    "torch": ("backend_torch/tests", "bench/tests/torch"),
    "jax": ("backend_jax/tests", "bench/tests/jax"),
    "mlx": ("backend_mlx/tests",),
}


class _QuietUvProbe(logging.Filter):
    """nox probes for the uv binary whenever it creates or reuses a virtualenv and logs "uv binary
    not found." each time.  This project installs with pip on purpose (pip takes the on-disk CPU
    torch wheel and the machine's torch cap; uv looks at neither), so the line is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "uv binary not found."


nox.logger.logger.addFilter(_QuietUvProbe())


def _install(session: nox.Session, *backends: str, extra: tuple = ()) -> None:
    _bytecode_on_import(session)
    # Frameworks first, with their pins, so the editable installs find them satisfied.
    args = [*TEST_DEPS, *BASE, *(a for b in backends for a in BACKEND_INSTALL[b]), *extra]
    # Skip pip (~15 s even when everything is satisfied) when this virtualenv was already
    # installed from the same arguments and pyproject files; the stamp lives in the virtualenv,
    # so a recreated one starts without it.
    digest = hashlib.sha256("\0".join(args).encode())
    for dist in DISTRIBUTIONS:
        digest.update(Path(dist, "pyproject.toml").read_bytes())
    location = getattr(session.virtualenv, "location", None)
    stamp = Path(location, ".attnres-install") if location else None
    with _install_lock(location):
        if stamp is not None and stamp.is_file() and stamp.read_text() == digest.hexdigest():
            session.log("dependencies unchanged since the last install: pip skipped")
            return
        # pip's own output is shown: a first install (torch, jax) takes minutes and should not be silent.
        session.install("--no-compile", *args, silent=False)
        if stamp is not None:
            stamp.write_text(digest.hexdigest())


@contextlib.contextmanager
def _install_lock(location: Optional[str]):
    """An exclusive lock on `<virtualenv>.install-lock` while `_install` checks and installs: a
    second nox process installing the same virtualenv (.ci/run installs the later sessions ahead,
    in the background) waits for the first and then finds the stamp.  No lock without fcntl."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        fcntl = None
    if not location or fcntl is None:
        yield
        return
    with open(f"{location}.install-lock", "w") as lock:  # closing it releases the lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _install_only(session: nox.Session) -> bool:
    """Whether nox runs with --install-only (nox has no public flag for it: its own `session.run`
    reads the same setting), so that nothing starts that `session.run` would skip."""
    runner = getattr(session, "_runner", None)
    return bool(getattr(getattr(runner, "global_config", None), "install_only", False))


def _bytecode_on_import(session: nox.Session) -> None:
    """pip compiles every module of every package it installs (torch alone: 26 s of a 38 s
    install on a 2-core Zen 1 VM), most of which no test imports: `_install` passes
    --no-compile, and Python writes the bytecode of the modules a run imports, once, under
    <virtualenv>/pycache (PYTHONPYCACHEPREFIX: nothing is written into the checkout or
    site-packages), also where PYTHONDONTWRITEBYTECODE is set (an empty value turns it off)."""
    location = getattr(session.virtualenv, "location", None)
    if location:
        session.env["PYTHONPYCACHEPREFIX"] = str(Path(location, "pycache"))
        session.env["PYTHONDONTWRITEBYTECODE"] = ""


def _tests(session: nox.Session, backend: str) -> None:
    _install(session, backend, extra=(XDIST, TRITON) if backend == "torch" else (XDIST,))
    if _install_only(session):  # nothing below but `session.run`s, which nox skips, and `_Beside`
        return
    # The conformance suite against this backend (the same checks `nox -s conformance` reports).
    dtypes = ("--dtype", "float64") if backend == "numpy" else ()  # the reference is float64-only
    # JAX compiles every case: its cases are split over one process per core (--shards).
    cores = str(os.cpu_count() or 1)
    split = ("--jobs", cores, "--shards", cores) if backend == "jax" else ()
    report = ("attnres-conformance", "--backend", backend, *dtypes, *split)
    # JAX's tests compile one program many times (a model at one shape in several tests, in a
    # subprocess on each worker): from JAX's persistent cache, the second compile is a read
    # (measured: 22 min of CPU instead of 26 on a cold cache; the suite's compiles are all distinct).
    env = _jax_cache(session) if backend == "jax" else {}
    # One pytest-xdist worker per core (at most 4), but for MLX (below): JAX's tests are
    # compile-bound and XLA compiles on one thread; torch's and the suite's are single-threaded
    # Python.  JAX's `heavy` tests are collected first (backend_jax/tests/conftest.py).  A module
    # fixture runs once on each worker that gets one of its tests (test_distributed's subprocess);
    # `--dist loadgroup` would keep them on one worker, but pytest-xdist 3.8 under pytest 9.2
    # ignores its xdist_group marks (tests of one group ran on both workers).
    workers = ("-n", str(min(os.cpu_count() or 1, 4)), "--dist", "load")
    # A report that keeps one core busy runs beside pytest: torch's run on the chunked kernel (the
    # fallback without a C compiler), while the workers wait for their subprocesses; MLX's, beside
    # one pytest process.  MLX compiles each fused kernel with g++ on first use (cold: ~5 min of a
    # core for the tests, as much for the report), and processes with kernel directories of their
    # own (MLX's is not safe for two at once) share few kernels: measured cold on 2 cores, pytest
    # then the report took 604 s, pytest on 2 workers then the report 528 s, pytest on 2 workers
    # beside the report ~500 s, one pytest process beside the report 423 s.
    beside = None
    if backend == "mlx":
        beside = _Beside(session, report, "mlx-report-kernels")
    elif backend == "torch":
        beside = _Beside(session, ("attnres-conformance", "--backend", "torch"), env={"ATTNRES_TORCH_CPU_C": "0"})
    try:
        # One pytest run per distribution, so that each reads its own pyproject.toml and names its
        # files from its own root (conformance/tests/test_cli.py, not test_cli.py under reference_numpy).
        for tests in BACKEND_TESTS[backend]:
            for marks, run_env in _compile_runs(session, tests, env):
                # exit 5 = nothing collected: fine when posargs (-k ...) select tests of another folder only
                session.run("pytest", tests, *(() if backend == "mlx" else workers), *marks, *session.posargs,
                            success_codes=[0, 5] if session.posargs else [0], env=run_env)
        if backend != "mlx":
            session.run(*report, env=env)
    except BaseException:
        if beside is not None:
            beside.finish(stop=True)
        raise
    if beside is not None:
        beside.finish(stop=False)


def _compile_runs(session: nox.Session, tests: str, env: dict) -> list:
    """[(pytest marker options, env)] for one folder of tests: backend_jax/tests in two runs, the
    fast-compile XLA_FLAGS (`JAX_FAST_COMPILE`) for all but `xla_default_compile`, then those with
    XLA's defaults; one run at the defaults when posargs choose markers (-m) themselves."""
    if tests != "backend_jax/tests" or "-m" in session.posargs:
        return [((), env)]
    flags = f"{os.environ.get('XLA_FLAGS', '')} {JAX_FAST_COMPILE}".strip()
    return [(("-m", "not xla_default_compile"), {**env, "XLA_FLAGS": flags}), (("-m", "xla_default_compile"), env)]


class _Beside:
    """A command of the session's virtualenv started in the background, its output kept in
    <virtualenv>/beside.log and printed by `finish`; `tmpdir`: its TMPDIR, a folder of the
    virtualenv (kept between runs); `env`: more environment variables."""

    def __init__(self, session: nox.Session, argv: tuple, tmpdir: str = "", env: Optional[dict] = None):
        env = env or {}
        location = Path(session.virtualenv.location)
        self.session, self.argv, self.log = session, argv, location / "beside.log"
        full = {**os.environ, **session.env, **env, "VIRTUAL_ENV": str(location),
                "PATH": os.pathsep.join([session.bin, os.environ.get("PATH", "")])}
        full = {k: v for k, v in full.items() if v is not None}  # nox's None: unset
        if tmpdir:
            full["TMPDIR"] = str(location / tmpdir)
            Path(full["TMPDIR"]).mkdir(exist_ok=True)
        shown = " ".join([*(f"{k}={v}" for k, v in env.items()), *argv])
        session.log(f"{shown} (beside pytest; its output, in {self.log}, follows pytest's)")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([str(Path(session.bin, argv[0])), *argv[1:]], stdout=out,
                                         stderr=subprocess.STDOUT, env=full)

    def finish(self, stop: bool) -> None:
        """Wait for it (or stop it: pytest failed), print its output, fail the session if it failed."""
        if stop:
            self.proc.terminate()
        code = self.proc.wait()
        self.session.log(f"{' '.join(self.argv)} (beside pytest) ended (exit {code}); its output:")
        sys.stdout.write(self.log.read_text(errors="replace"))
        sys.stdout.flush()
        if code != 0 and not stop:
            self.session.error(f"{' '.join(self.argv)} failed (exit {code})")


@nox.session(name="tests-numpy", tags=["tests"])
def tests_numpy(session: nox.Session) -> None:
    """The core, the reference, its finite-difference checks, golden-vector drift, and the suite's meta-tests."""
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
    """The main job: the conformance report over every backend (or those named in posargs).

    `nox -s conformance -- torch jax --quick`: backend names first, then options for
    attnres-conformance.  Reports go to reports/, named by what they cover (conformance.md and
    .json only for the full run; else e.g. conformance-torch.md).  Each backend's cases are split
    over one process per CPU core (--shards), and those processes run as many at once as there are
    cores (--jobs): JAX, which compiles every case, is the long pole.  Its executables are kept
    in JAX's persistent compilation cache in this virtualenv (`_jax_cache`), so a second run
    compiles nothing it compiled before."""
    backends, options = _conformance_args(session)
    _install(session, *backends)
    args = [a for b in backends for a in ("--backend", b)]
    cores = str(os.cpu_count() or 1)
    session.run("attnres-conformance", *args, "--report-dir", "reports", "--jobs", cores, "--shards", cores,
                *options, env=_jax_cache(session))


def _jax_cache(session: nox.Session) -> dict:
    """JAX's persistent compilation cache in this virtualenv (jax-compile-cache/, keyed by the
    program, the compile options and the jax/jaxlib versions), for every compile, however short or
    small; a variable already set wins.  No size limit: with one (JAX_COMPILATION_CACHE_MAX_SIZE)
    JAX stats every entry under a file lock at each write (on this project's 2-core machine,
    tests-jax's pytest went from 13 to over 17 minutes), and it needs `filelock`, without which
    every read fails.  An entry is ~15 KB and a run adds only programs it has not compiled before:
    delete the folder (or the virtualenv) to start again."""
    location = getattr(session.virtualenv, "location", None) or ".nox"
    cache = {"JAX_COMPILATION_CACHE_DIR": str(Path(location, "jax-compile-cache").resolve()),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    return {k: os.environ.get(k, v) for k, v in cache.items()}


def _conformance_args(session: nox.Session) -> tuple:
    """posargs -> (backend names, attnres-conformance options): names up to the first option;
    a name that is not a backend ends the session with the valid names (not a KeyError)."""
    posargs = list(session.posargs)
    first = next((i for i, a in enumerate(posargs) if a.startswith("-")), len(posargs))
    backends, options = posargs[:first] or list(BACKEND_INSTALL), posargs[first:]
    unknown = [b for b in backends if b not in BACKEND_INSTALL]
    if unknown:
        session.error(f"unknown backend {', '.join(map(repr, unknown))}: choose from {', '.join(BACKEND_INSTALL)} "
                      "(e.g. nox -s conformance -- torch jax; options for attnres-conformance after the names)")
    return backends, options


#: The documentation site (mkdocs.yml): pinned, so a new release cannot break `--strict` without a commit.
DOCS = ("mkdocs==1.6.1", "mkdocs-material==9.8.2", "mkdocstrings==1.0.8", "mkdocstrings-python==2.0.11")


@nox.session(name="docs", tags=["tests"])
def docs(session: nox.Session) -> None:
    """The documentation site, `mkdocs build --strict` (a warning, a broken link or anchor, an API
    entry griffe cannot read fails it) into the session's virtualenv (`-- --site-dir DIR` to keep
    it elsewhere).  griffe reads the packages' sources without importing them: no framework installed."""
    session.install(*DOCS)
    site = Path(session.virtualenv.location, "site")
    session.run("mkdocs", "build", "--strict", "--site-dir", str(site), *session.posargs,
                env={"NO_MKDOCS_2_WARNING": "1"})
    if "--site-dir" not in session.posargs:
        session.log(f"site built in {site}: open {site / 'index.html'}, or serve it with "
                    f"`python -m http.server -d {site}` and browse http://localhost:8000 "
                    "(`mkdocs serve` rebuilds it as you edit)")


@nox.session(name="vectors")
def vectors(session: nox.Session) -> None:
    """Regenerate the golden vectors (manifest.json + one .npz per case) from the case definitions,
    in the suite's package data (spec/vectors links there), so its wheel ships them."""
    _install(session, "numpy")
    session.run("python", "-m", "attnres_numpy.vectors", GOLDEN, *session.posargs)


@nox.session(name="lint")
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")


#: The public ports of the compliance table (docs/ports.md), pinned: each release is checked as
#: released.  Liger-kernel 0.8.3 (the release that dropped every source past 32) and 0.8.4 (the
#: fix) are installed by the run itself, without dependencies, into folders of their own beside this 0.8.5
#: (attnres_conformance.ports.compliance.PORTS holds the pins and the expected verdicts).
PORTS_INSTALL = (TORCH, TRITON, "packaging", "flash-linear-attention==0.6.0", "fla-core==0.6.0",
                 "attn-res==0.1.0", "liger-kernel==0.8.5", MLX, MLX_LM)


@nox.session(name="ports", tags=["tests"])
def ports(session: nox.Session) -> None:
    """The public ports (FLA, attn-res, Liger-kernel 0.8.3, 0.8.4 and 0.8.5, mlx-lm's Kimi K3) from their pinned releases:
    the suite on each, each verdict against the expected one, and docs/ports.md against this run's
    table (`nox -s ports -- --write` rewrites it).  Reports go to reports/ports/."""
    _install(session, "numpy", extra=PORTS_INSTALL)
    session.run("python", "-m", "attnres_conformance.ports.compliance", "--reports", "reports/ports",
                "--table", "docs/ports.md", *session.posargs)
    # The adapters' own tests, with their ports installed (elsewhere they skip, naming the install).
    session.run("pytest", "conformance/tests/test_public_ports.py", env={"TRITON_INTERPRET": "1"})
