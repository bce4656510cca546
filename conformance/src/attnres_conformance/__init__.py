"""attnres-conformance: checks any port of Attention Residuals against the float64 reference.

Modules: `backend` (the protocol a port implements), `registry` (selecting a backend),
`cases` (the generated cases), `checks` (running one), `tolerances` and `naive` (how results
are judged), `runner` (`run_conformance` and the report), `cli` (`attnres-conformance`),
`pytest_plugin` (`pytest --attnres-backend`), `adapters` (the one `call_op`/`call_probe`, `base.Adapter`,
and each framework's primitives, imported by name only when chosen; `reference_backend` re-exports
the numpy one);
`golden/` holds the golden vectors (package data; `spec/vectors` in a checkout links to it).
`python -m attnres_conformance` runs the CLI.
Importing this package imports nothing (the pytest plugin loads it in every pytest run).
"""

__version__ = "0.1.0"
#: The version of spec/SPEC.md the suite checks (its "Version" line).
SPEC_VERSION = "0.1"
