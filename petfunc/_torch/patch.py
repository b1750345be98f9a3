"""A change to torch's global state that holds while at least one ``with`` block
uses it: installed on entering the first, undone on leaving the last (re-entrant,
thread-safe). petfunc's vmap batching rules, FFT shape functions and inductor
kernel-grouping hooks live in such scopes, so that outside them torch behaves as it
ships."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any


class Scoped:
    """``install()`` returns what ``uninstall(it)`` undoes; ``installed`` is that
    object while some block is active, else ``None``."""

    def __init__(self, install: Callable[[], Any], uninstall: Callable[[Any], None]):
        self._install = install
        self._uninstall = uninstall
        self._lock = threading.RLock()
        self._depth = 0
        self.installed = None

    @contextlib.contextmanager
    def __call__(self):
        with self._lock:
            if self._depth == 0:
                self.installed = self._install()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._uninstall(self.installed)
                    self.installed = None


def scoped_attribute(replacement: Callable[[], Any]) -> Scoped:
    """A :class:`Scoped` that replaces one attribute: ``replacement()`` returns
    ``(owner, name, value)``, or None when there is nothing to replace (another torch
    version, a setting that keeps torch's own); ``owner.name`` is ``value`` inside the
    blocks and what it was before outside."""

    def install():
        target = replacement()
        if target is None:
            return None
        owner, name, value = target
        original = getattr(owner, name)
        setattr(owner, name, value)
        return owner, name, original

    def uninstall(saved):
        if saved is not None:
            owner, name, original = saved
            setattr(owner, name, original)

    return Scoped(install, uninstall)
