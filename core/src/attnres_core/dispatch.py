"""The framework-neutral half of the public backend contract: the bookkeeping that every
backend's `dispatch` module (`attnres_torch.dispatch`, `attnres_jax.dispatch`,
`attnres_mlx.dispatch`) shares, written once (standard library only).

The contract, the same names in every backend and the path a third-party port takes:

  IMPLEMENTATIONS   the implementation names in preference order (the automatic choice takes the
                    first one that takes a call).
  availability()    name -> None where it can serve calls here, else a one-line reason.
  use_impl(name, **options)
                    a context manager forcing `name` for the op calls made in the block, scoped
                    to the current context (thread, asyncio task); "auto" is the automatic
                    choice.
  Choice            (op, impl, refused): what served one op call.
  last_choice()     the Choice of the most recent op call in this process (any thread).
  impl_counts()     op calls served per implementation since import (a copy).
  capabilities()    {"dtypes", "devices", "fused_kernel", "deterministic"}.

This module holds what is the same everywhere: `Choice`, and a `Registry` per backend with the
forced-implementation state behind `use_impl` (a `contextvars.ContextVar`), the record behind
`last_choice` / `impl_counts` (under a lock: threads may call the ops at once), and the two
rules that build a Choice (`Registry.auto` for the automatic choice, `Registry.refused_before`
under a forcing).  A port supplies the rest: its implementation objects and their support check
for one call (name -> None, or why not), `availability()` and `capabilities()` (they ask its
framework), what `use_impl` accepts (its names' validation and error messages, its options: what a
forcing carries besides the name, e.g. JAX's Pallas tile) and when a call is not recorded (torch
while torch.compile traces).

The refusal rule (`Choice.refused`): every implementation before `impl` in preference order
appears in `refused` once, in that order, with why it did not serve the call, so
`[name for name, _ in refused] + [impl]` is always a prefix of `IMPLEMENTATIONS`.  Under a
forcing, the implementations that were not forced read "not forced (use_impl('name'))", and a
forced one that fell back (torch's merge without a merge kernel, MLX's Metal with float64) gives
its own reason.  Why this rule, not an empty `refused` under a forcing: then `refused` answers
the same question however the call was chosen, and a forced call never reads like an automatic
choice whose preferred kernels all refused (a forced "chunked" on a machine with the C kernel
would otherwise look as if that kernel could not take the call).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import threading
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Sequence, Tuple

#: The public ops every backend dispatches.
OPS = ("depth_attention", "depth_attention_multi", "merge_partial")

Refusals = Tuple[Tuple[str, str], ...]


class Choice(NamedTuple):
    """What served one op call.

    op: "depth_attention", "depth_attention_multi" or "merge_partial".
    impl: the name of the implementation that served it.
    refused: (name, reason) for each implementation before `impl` in preference order, in that
      order: why it did not take the call ("not forced (...)" for the ones a forcing passed over).
    """

    op: str
    impl: str
    refused: Refusals = ()


def not_forced(how: str) -> str:
    """The refusal reason of an implementation a forcing passed over; how: "use_impl('xla')",
    "impl='xla'"."""
    return f"not forced ({how})"


class Registry:
    """One backend's contract state: its implementation names in preference order, the forcing
    of `use_impl` and the record of the choices.

    backend: the package name (names the context variable).  implementations: the names, in
    preference order.  The forcing state is whatever the backend's `use_impl` passes to
    `forcing` (a name, or a tuple of the name and its options); None is the automatic choice.
    """

    def __init__(self, backend: str, implementations: Sequence[str]):
        names = tuple(implementations)
        if not names or len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"implementations: expected distinct names, got {names!r}")
        self.implementations: Tuple[str, ...] = names
        self._forced: contextvars.ContextVar = contextvars.ContextVar(f"{backend}_impl", default=None)
        self._lock = threading.Lock()
        self._counts: collections.Counter = collections.Counter()
        self._last: Optional[Choice] = None

    # -- the forcing ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def forcing(self, state: Any) -> Iterator[None]:
        """Set the forcing state for the block (None: the automatic choice); nests, and is
        restored on exit, also on an exception."""
        token = self._forced.set(state)
        try:
            yield
        finally:
            self._forced.reset(token)

    def forced(self) -> Any:
        """The state set by the innermost `forcing` block of this context, or None."""
        return self._forced.get()

    # -- the two rules that build a Choice --------------------------------------------------------

    def refused_before(self, impl: str, how: str, reasons: Optional[Mapping[str, str]] = None) -> Refusals:
        """`Choice.refused` for a call that `impl` serves under a forcing described by `how`:
        each implementation before `impl`, with its reason from `reasons` (the forced one that
        fell back) or "not forced (how)"."""
        reasons = reasons or {}
        before = self.implementations[:self.implementations.index(impl)]
        return tuple((name, reasons.get(name) or not_forced(how)) for name in before)

    def auto(self, reason_of: Callable[[str], Optional[str]],
             reasons: Optional[Mapping[str, str]] = None) -> Tuple[Optional[str], Refusals]:
        """The automatic choice: (the first implementation whose `reason_of(name)` is None, the
        refusals before it); (None, every refusal) when none takes the call.  `reasons`: names
        already refused (with why), not asked again."""
        reasons = reasons or {}
        refused = []
        for name in self.implementations:
            reason = reasons[name] if name in reasons else reason_of(name)
            if reason is None:
                return name, tuple(refused)
            refused.append((name, reason))
        return None, tuple(refused)

    # -- the record ------------------------------------------------------------------------------

    def record(self, choice: Choice) -> Choice:
        """Note that `choice` served a call (for `last_choice` and `impl_counts`)."""
        if choice.impl not in self.implementations:
            raise ValueError(f"choice.impl: expected one of {self.implementations}, got {choice.impl!r}")
        with self._lock:
            self._counts[choice.impl] += 1
            self._last = choice
        return choice

    def last_choice(self) -> Optional[Choice]:
        """The Choice of the most recent recorded op call in this process (any thread), or None."""
        with self._lock:
            return self._last

    def last_impl(self) -> Optional[str]:
        """`last_choice().impl`, or None before the first call."""
        choice = self.last_choice()
        return None if choice is None else choice.impl

    def impl_counts(self) -> collections.Counter:
        """A copy of how many recorded op calls each implementation served."""
        with self._lock:
            return collections.Counter(self._counts)


__all__ = ["OPS", "Choice", "Registry", "not_forced"]
