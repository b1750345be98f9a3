"""PET hyperparameters: :class:`PETConfig`, with metatrain's names and defaults.

Every field has the name and default of metatrain's ``pet`` model hypers (v2026.4),
so a metatrain ``model_hypers`` dict converts with :meth:`PETConfig.from_hypers`.
The config is frozen and hashable: it is a static argument of every pure function.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ase.data import atomic_numbers


_CHOICES = {
    "cutoff_function": ("Bump", "Cosine"),
    "adaptive_cutoff_method": ("solver", "grid"),
    "normalization": ("RMSNorm", "LayerNorm"),
    "activation": ("SwiGLU", "SiLU"),
    "transformer_type": ("PreLN", "PostLN"),
    "featurizer_type": ("feedforward", "residual"),
}

_POSITIVE_INT = (
    "d_pet",
    "d_head",
    "d_node",
    "d_feedforward",
    "num_heads",
)
# metatrain builds these with 0 (no transformer layer; for the feedforward
# featurizer, no message passing: the embeddings are read out)
_NON_NEGATIVE_INT = ("num_attention_layers", "num_gnn_layers")

#: the largest atomic number (oganesson)
MAX_ATOMIC_NUMBER = 118


def atomic_number(entry, index: int, types) -> int:
    """The atomic number of ``entry``, the ``index``-th of ``types``: an integer (Python's
    or numpy's, not a bool, not a float) or a chemical symbol (``"H"``, ``"Cu"``)."""
    if isinstance(entry, str):
        if atomic_numbers.get(entry, 0) == 0:  # "X", the dummy atom, is 0
            raise ValueError(
                f"atomic_types entry {index} is {entry!r}, not a chemical symbol (such as 'H' or 'Cu'); "
                f"give atomic numbers or symbols, got {types!r}"
            )
        return atomic_numbers[entry]
    try:
        if isinstance(entry, (bool, np.bool_)):
            raise TypeError("a bool")
        # integers of every kind (numpy's, integer tensors) have __index__; floats do not,
        # so 1.7 is never rounded to 1
        return operator.index(entry)
    except TypeError:
        hint = f" (write {int(entry)})" if isinstance(entry, float) and float(entry).is_integer() else ""
        raise ValueError(
            f"atomic_types entry {index} is {entry!r}, not an atomic number: give integers such as 6, "
            f"or chemical symbols such as 'C'{hint}; got {types!r}"
        ) from None


def checked_atomic_types(types) -> tuple[int, ...]:
    """``types`` as sorted unique atomic numbers 1..118 (metatrain's order), or
    ``ValueError`` naming the offending entry. Entries are integers or chemical symbols."""
    if isinstance(types, (str, bytes, Mapping)) or not isinstance(types, Iterable):
        raise ValueError(f"atomic_types must be a sequence of atomic numbers, got {types!r}")
    given = tuple(types)
    numbers = tuple(atomic_number(entry, index, given) for index, entry in enumerate(given))
    if len(numbers) == 0:
        raise ValueError("atomic_types must not be empty")
    for index, number in enumerate(numbers):
        if number < 0:
            raise ValueError(
                f"atomic_types must be non-negative, got {numbers}: entry {index} is {number}, "
                f"and atomic numbers run from 1 (H) to {MAX_ATOMIC_NUMBER} (Og)"
            )
        if not 1 <= number <= MAX_ATOMIC_NUMBER:
            raise ValueError(
                f"atomic_types entry {index} is {number}, not an atomic number from 1 (H) to "
                f"{MAX_ATOMIC_NUMBER} (Og); got {numbers}"
            )
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"atomic_types has duplicates: {numbers}")
    return tuple(sorted(numbers))


@dataclass(frozen=True)
class LongRangeConfig:
    """metatrain's ``long_range`` hypers (torch-pme Coulomb features, lengths in Å).

    Attributes:
        enable: add the long-range features to the readout node features.
        use_ewald: metatrain's switch; it only matters while metatrain trains (it
            always uses Ewald then). petfunc trains with Ewald and evaluates with P3M,
            as metatrain does, whatever this says.
        smearing: Gaussian width sigma splitting 1/r into real and reciprocal space.
        kspace_resolution: Ewald ``lr_wavelength`` (k-vectors with wavelength >= it)
            and P3M ``mesh_spacing``.
        interpolation_nodes: P3M charge-assignment order, 1 to 5.
    """

    enable: bool = False
    use_ewald: bool = False
    smearing: float = 1.4
    kspace_resolution: float = 1.33
    interpolation_nodes: int = 5

    def __post_init__(self) -> None:
        for name in ("enable", "use_ewald"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"long_range.{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("smearing", "kspace_resolution"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"long_range.{name} must be a positive number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"long_range.{name} must be finite, got {value!r}")
            object.__setattr__(self, name, float(value))
        nodes = self.interpolation_nodes
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= 5:
            raise ValueError(f"long_range.interpolation_nodes must be an integer from 1 to 5, got {nodes!r}")


@dataclass(frozen=True)
class PETConfig:
    """Hyperparameters of a PET model (lengths in Å).

    Attributes:
        atomic_types: atomic numbers the model knows, e.g. ``(1, 6, 7, 8)`` (or their
            chemical symbols, ``("H", "C", "N", "O")``), each from 1 to 118, no
            duplicates. Stored sorted, as integers; the species index of a type is its
            position in this tuple.
        cutoff: neighbour-list radius r_c, also the largest adaptive cutoff.
        cutoff_width: width w of the switching function f(r) used by the network.
        cutoff_function: ``"Bump"`` (C-infinity tanh-cot) or ``"Cosine"``.
        num_neighbors_adaptive: target neighbour count of the adaptive cutoff, or
            ``None`` for a fixed cutoff.
        adaptive_cutoff_method: ``"solver"`` (Newton-bisection) or ``"grid"`` (legacy).
        cutoff_width_adaptive: taper width used only to count neighbours in the
            adaptive cutoff.
        d_pet: width of the edge tokens (transformer model dimension).
        d_head: hidden width of the readout heads.
        d_node: width of the node features. When it differs from ``d_pet`` the
            transformer layers carry a node residual stream of this width.
        d_feedforward: hidden width of the edge feed-forward network.
        num_heads: attention heads; ``d_pet`` must be divisible by it.
        num_attention_layers: transformer layers inside each GNN layer.
        num_gnn_layers: message-passing layers.
        normalization: ``"RMSNorm"`` or ``"LayerNorm"`` inside transformer layers.
        activation: ``"SwiGLU"`` or ``"SiLU"`` feed-forward networks.
        attention_temperature: attention scores are divided by sqrt(d_pet/num_heads)
            times this.
        transformer_type: ``"PreLN"`` or ``"PostLN"``.
        featurizer_type: ``"feedforward"`` (modern) or ``"residual"`` (original PET).
        zbl: add the ZBL short-range repulsion to the energy.
        long_range: long-range Coulomb features (:class:`LongRangeConfig`).
        system_conditioning: condition the node features on each structure's total
            charge and spin multiplicity (metatrain's charge/spin embeddings).
        max_charge: the conditioning supports total charges in
            ``[-max_charge, max_charge]`` (elementary charges).
        max_spin_multiplicity: it supports spin multiplicities 2S+1 in
            ``[1, max_spin_multiplicity]``.
    """

    atomic_types: tuple[int, ...] = (1, 6, 7, 8)
    cutoff: float = 4.5
    cutoff_width: float = 0.5
    cutoff_function: str = "Bump"
    num_neighbors_adaptive: float | None = None
    adaptive_cutoff_method: str = "solver"
    cutoff_width_adaptive: float = 1.0
    d_pet: int = 128
    d_head: int = 128
    d_node: int = 256
    d_feedforward: int = 256
    num_heads: int = 8
    num_attention_layers: int = 2
    num_gnn_layers: int = 2
    normalization: str = "RMSNorm"
    activation: str = "SwiGLU"
    attention_temperature: float = 1.0
    transformer_type: str = "PreLN"
    featurizer_type: str = "feedforward"
    zbl: bool = False
    long_range: LongRangeConfig = field(default_factory=LongRangeConfig)
    system_conditioning: bool = False
    max_charge: int = 10
    max_spin_multiplicity: int = 10

    def __post_init__(self) -> None:
        self._check_values()
        self._check_relations()

    def _check_values(self) -> None:
        """Check and normalise every hyper on its own."""
        object.__setattr__(self, "atomic_types", checked_atomic_types(self.atomic_types))

        if isinstance(self.long_range, Mapping):
            known = {f.name for f in dataclasses.fields(LongRangeConfig)}
            unknown = sorted(set(self.long_range) - known)
            if unknown:
                raise ValueError(f"unknown long_range hyperparameters: {unknown}")
            object.__setattr__(self, "long_range", LongRangeConfig(**self.long_range))
        if not isinstance(self.long_range, LongRangeConfig):
            raise ValueError(f"long_range must be a mapping of its hypers, got {self.long_range!r}")

        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            # metatrain compares some of these case-insensitively; normalise
            match = [c for c in choices if isinstance(value, str) and c.lower() == value.lower()]
            if not match:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
            object.__setattr__(self, name, match[0])

        for name in _POSITIVE_INT:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in _NON_NEGATIVE_INT:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("cutoff", "cutoff_width", "cutoff_width_adaptive", "attention_temperature"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
            if not math.isfinite(value):
                # no length or width means anything at infinity: a periodic cell has
                # infinitely many neighbours within an infinite cutoff
                raise ValueError(f"{name} must be finite, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.num_neighbors_adaptive is not None:
            value = self.num_neighbors_adaptive
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"num_neighbors_adaptive must be a number >= 0 or None, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(
                    f"num_neighbors_adaptive must be finite, got {value!r} (None: a fixed cutoff)"
                )
            object.__setattr__(self, "num_neighbors_adaptive", float(value))
        if not isinstance(self.system_conditioning, bool):
            raise ValueError(f"system_conditioning must be true or false, got {self.system_conditioning!r}")
        for name, low in (("max_charge", 0), ("max_spin_multiplicity", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

    def _check_relations(self, given=None) -> None:
        """The rules between two hypers; with ``given`` (a set of names) only those
        between given ones."""

        def both(a, b):
            return given is None or (a in given and b in given)

        if (
            both("num_gnn_layers", "featurizer_type")
            and self.num_gnn_layers == 0
            and self.featurizer_type != "feedforward"
        ):
            raise ValueError(
                "num_gnn_layers 0 needs featurizer_type 'feedforward' (the residual featurizer reads "
                "out every GNN layer, and there would be none; metatrain fails there too)"
            )
        if both("d_pet", "num_heads") and self.d_pet % self.num_heads != 0:
            raise ValueError(
                f"d_pet must be divisible by num_heads, got d_pet={self.d_pet} and num_heads={self.num_heads}"
            )

    @classmethod
    def check_partial(cls, hypers: Mapping[str, Any]) -> None:
        """Check the hypers of a partial ``model_hypers`` mapping, such as an options
        file's ``architecture.model`` for fine-tuning, whose missing keys come from a
        checkpoint rather than the defaults: every given value, and the rules between
        two hypers only where both are given. Raises as the constructor does."""
        hypers = dict(hypers)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(hypers) - known)
        if unknown:
            raise ValueError(f"unknown PET hyperparameters: {unknown}")
        values = {"atomic_types": (1,), **hypers}
        config = object.__new__(cls)
        for f in dataclasses.fields(cls):
            if f.name in values:
                value = values[f.name]
            elif f.default is not dataclasses.MISSING:
                value = f.default
            else:
                value = f.default_factory()
            object.__setattr__(config, f.name, value)
        config._check_values()
        config._check_relations(set(hypers))

    # derived quantities ------------------------------------------------------------
    @property
    def num_species(self) -> int:
        return len(self.atomic_types)

    @property
    def num_readout_layers(self) -> int:
        """1 for the feedforward featurizer, ``num_gnn_layers`` for the residual one."""
        return 1 if self.featurizer_type == "feedforward" else self.num_gnn_layers

    @property
    def adaptive(self) -> bool:
        return self.num_neighbors_adaptive is not None

    # conversions ------------------------------------------------------------------
    def to_hypers(self) -> dict:
        """metatrain-style ``model_hypers`` dict (plus ``atomic_types``)."""
        out = dataclasses.asdict(self)
        out["atomic_types"] = list(self.atomic_types)
        return out

    @classmethod
    def from_hypers(cls, hypers: Mapping[str, Any], atomic_types=None) -> PETConfig:
        """Build a config from a metatrain ``model_hypers`` mapping.

        Keys that petfunc does not know raise, so a misspelt option never goes unseen.
        """
        hypers = dict(hypers)
        if atomic_types is not None:
            hypers["atomic_types"] = tuple(atomic_types)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(hypers) - known)
        if unknown:
            raise ValueError(f"unknown PET hyperparameters: {unknown}")
        if "long_range" in hypers and isinstance(hypers["long_range"], Mapping):
            hypers["long_range"] = LongRangeConfig(**dict(hypers["long_range"]))
        return cls(**hypers)
