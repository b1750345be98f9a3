"""The one type of petfunc's changes to torch's internals: :class:`Patch`.

A patch holds while at least one user holds it (``with patch.scope():`` blocks, or
``install()`` calls not yet undone by ``uninstall()``): it is installed for the
first and undone after the last (re-entrant, thread-safe), so that outside petfunc's
own work torch behaves as it ships.

Every patch is optional. It is installed only where its version gate
(:mod:`petfunc._torch.versions`) says this torch needs it and the settings
(:mod:`petfunc._torch.settings`: ``PETFUNC_STOCK_TORCH``, ``PETFUNC_PATCHES_OFF``)
leave it on. If installing it fails (a private name of torch moved: an
``AttributeError``, ``ImportError``, ``TypeError``...), petfunc warns once per patch
(:class:`PatchWarning`) and runs torch's own code instead. A speed patch off costs
time only; a correctness patch off makes the path that needs it raise a clear
error (each module says which).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from petfunc._torch import settings


SPEED = "speed"
CORRECTNESS = "correctness"


class PatchWarning(RuntimeWarning):
    """A patch of torch's internals could not be installed on this torch; petfunc runs
    torch's own code in its place."""


_installed: set[str] = set()  # names of the patches installed now
_registry_lock = threading.Lock()


def installed_names() -> list[str]:
    """Names of the patches installed right now, sorted."""
    with _registry_lock:
        return sorted(_installed)


class Patch:
    """One change to torch's internals, installed while petfunc needs it.

    Attributes:
        name: the name the settings use (``PETFUNC_PATCHES_OFF=name``).
        purpose: ``"speed"`` (off: slower, the same results) or ``"correctness"``
            (off: the path that needs it raises a clear error).
        needed: the version gate: false where this torch does not need the patch
            (it is then never installed).
        summary: one line: what it changes and why.
        module: the module that implements it (for its own tests).
        failure: the error of the latest failed install, or None.
        warned: whether the warning about a failed install was given (once a process).
    """

    def __init__(
        self,
        name: str,
        *,
        purpose: str,
        needed: bool,
        summary: str,
        module: Any,
        install: Callable[[], Any],
        uninstall: Callable[[Any], None],
        targets: Callable[[], list],
        state: Callable[[], tuple] | None = None,
        wanted: Callable[[], bool] | None = None,
    ):
        if purpose not in (SPEED, CORRECTNESS):
            raise ValueError(f"purpose must be {SPEED!r} or {CORRECTNESS!r}, not {purpose!r}")
        self.name, self.purpose, self.needed, self.summary, self.module = (
            name,
            purpose,
            needed,
            summary,
            module,
        )
        self._install, self._uninstall = install, uninstall
        self._targets, self._state = targets, state
        self._wanted = wanted
        self._lock = threading.RLock()
        self._depth = 0
        self._saved = None
        self.installed = False
        self.failure: BaseException | None = None
        self.warned = False

    def __repr__(self):
        return f"<Patch {self.name} ({self.purpose}){' installed' if self.installed else ''}>"

    def allowed(self) -> bool:
        """Whether the version gate and the settings leave the patch on."""
        return self.needed and settings.patch_on(self.name)

    def enabled(self) -> bool:
        """Whether the next install will try to change torch: :meth:`allowed`, and
        (for a patch that sets a value) a setting asks for a change."""
        return self.allowed() and (self._wanted is None or self._wanted())

    def targets(self) -> list:
        """``[(owner, attribute name)]``: what the patch looks up in torch to install
        itself (an attribute missing there makes the install fail)."""
        return self._targets()

    def state(self) -> tuple:
        """What the patch changes, as it is now, comparable with ``==``: the objects at
        :meth:`targets` (the items of a list), or the dispatcher's registrations it edits."""
        if self._state is not None:
            return self._state()
        return tuple(_current(owner, name) for owner, name in self.targets())

    def install(self) -> bool:
        """Hold the patch; installs it for the first holder. Returns whether it is
        installed (false where disabled, or where installing failed: with a
        :class:`PatchWarning` the first time)."""
        with self._lock:
            if self._depth == 0:
                self._try_install()  # a bad setting raises here, and nothing is held
            self._depth += 1
            return self.installed

    def uninstall(self) -> None:
        """Let go of the patch; undoes it after the last holder."""
        with self._lock:
            if self._depth == 0:
                raise RuntimeError(f"patch {self.name}: uninstall() without install()")
            self._depth -= 1
            if self._depth == 0 and self.installed:
                try:
                    self._uninstall(self._saved)
                finally:
                    self._saved, self.installed = None, False
                    with _registry_lock:
                        _installed.discard(self.name)

    @contextlib.contextmanager
    def scope(self):
        """The patch held for a ``with`` block."""
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    def _try_install(self):
        if not self.enabled():
            return
        try:
            self._saved = self._install()
        except Exception as error:  # noqa: BLE001 - any failure: torch's internals differ; run stock
            self.failure = error
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"petfunc could not install its patch {self.name!r} of torch {torch.__version__} "
                    f"internals ({error!r}); running torch's own code there instead"
                    + (" (slower)" if self.purpose == SPEED else ""),
                    PatchWarning,
                    stacklevel=4,
                )
            return
        self.failure, self.installed = None, True
        with _registry_lock:
            _installed.add(self.name)


def _current(owner, name):
    value = getattr(owner, name, _MISSING)
    return tuple(value) if isinstance(value, list) else value


_MISSING = object()


def replacing(
    name: str,
    *,
    purpose: str,
    needed: bool,
    summary: str,
    module: Any,
    targets: Callable[[], list],
    replacements: Callable[..., list],
    wanted: Callable[[], bool] | None = None,
) -> Patch:
    """A :class:`Patch` that replaces attributes: ``targets()`` lists
    ``(owner, name)`` pairs, ``replacements(*originals)`` returns their new values
    given the current ones. Every original is looked up before anything is replaced,
    and uninstalling puts the very same objects back."""

    def install():
        pairs = targets()
        originals = [getattr(owner, attribute) for owner, attribute in pairs]
        values = replacements(*originals)
        done = []
        try:
            for (owner, attribute), value, original in zip(pairs, values, originals):
                setattr(owner, attribute, value)
                done.append((owner, attribute, original))
        except BaseException:
            uninstall(done)
            raise
        return done

    def uninstall(saved):
        for owner, attribute, original in reversed(saved):
            setattr(owner, attribute, original)

    return Patch(
        name,
        purpose=purpose,
        needed=needed,
        summary=summary,
        module=module,
        install=install,
        uninstall=uninstall,
        targets=targets,
        wanted=wanted,
    )


@functools.lru_cache(maxsize=1)
def codegen_hash() -> str:
    """Hash of the petfunc modules that change what inductor generates for a given
    graph (:mod:`petfunc.compile` and :mod:`petfunc._torch`: the summation choice,
    the FFT shape functions, the kernel grouping, the stride analysis, the addmm split)."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for path in sorted([*package.joinpath("compile").glob("*.py"), *package.joinpath("_torch").glob("*.py")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:32]
