"""Checks shared by the sections of the options: known keys, numbers, module names,
and the merge of user values over defaults. Every error names the option."""

from __future__ import annotations

import copy
import difflib
import math
from collections.abc import Mapping


def check_keys(section: Mapping, allowed, where: str) -> None:
    """Raise ``ValueError`` naming the first key of ``section`` not in ``allowed``
    (with the closest valid key, if one is close); ``where`` is the section's dotted
    name (``""`` at the top level)."""
    if not isinstance(section, Mapping):
        raise ValueError(f"option '{where}' must be a mapping, got {section!r}")
    for key in section:
        if key not in allowed:
            name = f"{where}.{key}" if where else str(key)
            close = difflib.get_close_matches(str(key), [str(a) for a in allowed], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(f"unknown option '{name}'{hint}; valid keys here: {sorted(map(str, allowed))}")


def merge(defaults: Mapping, given: Mapping) -> dict:
    """A deep copy of ``defaults`` with ``given`` laid over it, section by section."""
    out = copy.deepcopy(dict(defaults))
    for key, value in given.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def module_names(value, name: str) -> None:
    """Raise ``ValueError`` unless ``value`` is a list of module names (strings)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"option '{name}' must be a list of module names, got {value!r}")


def number(value, name: str, positive=False, integer=False, minimum=None, maximum=None):
    """``value`` of option ``name`` as a float (an int with ``integer``), checked
    against the bounds given; a bool is not a number, nor are YAML's ``.nan`` and
    ``.inf`` (no option of petfunc means anything by them: "no limit" is ``null``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"option '{name}' must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"option '{name}' must be a finite number, got {value!r}")
    if integer and int(value) != value:
        raise ValueError(f"option '{name}' must be an integer, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"option '{name}' must be positive, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"option '{name}' must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"option '{name}' must be <= {maximum}, got {value!r}")
    return int(value) if integer else float(value)
