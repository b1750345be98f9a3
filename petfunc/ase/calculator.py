"""An ASE calculator for PET: :class:`PETCalculator`.

It needs ``ase`` (a dependency of petfunc, as are :mod:`petfunc.relax` and
:mod:`petfunc.dynamics`, which use it)::

    from petfunc.ase import PETCalculator
    atoms.calc = PETCalculator.from_checkpoint("model.pt", compile=True)

Every calculation evaluates energy, per-atom energies, forces and the strain
derivative in one call of
``energy_terms_forces_strain_derivative(model.energy_terms)``: eagerly (by
``torch.autograd``, the faster eager path, :mod:`petfunc.derivatives`), or, with
``compile=True``, through :func:`petfunc.compile` (one ``make_fx`` trace of the
``torch.func`` derivative, compiled for symbolic sizes; the trace is cached on disk,
so a later process with the same config skips it), or in a ``petfunc export``
artifact (:meth:`PETCalculator.from_exported`). The structure is batched together with
:func:`petfunc.data.padding_sample` (a 3-atom dummy molecule), so that no size the
compiled graph sees (structures, atoms, edges, neighbours per atom) is 0 or 1: those
are the sizes torch specialises on, and a single structure, or one atom, would
recompile. The neighbour list is rebuilt with vesin at every call; the number of
edges changing from one MD step to the next never recompiles (``num_compilations``
stays 1).

Conventions, as in metatomic's ASE calculator (``metatomic_ase.MetatomicCalculator``)
for the same model:

* ``stress = (1/V) dE/d eps`` in eV/Å^3 with V = ``atoms.cell.volume``, returned in
  ASE's Voigt order (xx, yy, zz, yz, xz, xy) with the off-diagonal pairs averaged
  ((s_ab + s_ba)/2: PET's strain derivative is not exactly symmetric);
* a cell with zero volume (a molecule) has no stress: asking for it raises
  :class:`~ase.calculators.calculator.PropertyNotImplementedError` (metatomic
  returns ``inf`` there); a partly periodic structure whose ASE cell has a volume
  gets metatomic's number, with the same warning;
* ``energies`` are per-atom energies, summing to ``energy`` (every calculation
  stores them);
* a float32 model gets the atoms wrapped into the cell along its periodic
  directions, in float64 (the results are those of the same structure; atoms that
  diffused far from the origin would cost the float32 edge vectors digits);
* a model with ``system_conditioning`` reads the total charge from
  ``atoms.info["charge"]`` and the spin multiplicity 2S+1 from
  ``atoms.info["spin_multiplicity"]`` (or ``atoms.info["spin"]``, OMol25's name),
  0 and 1 when absent; changing them invalidates the results.

With ``ensemble_params`` (a parameter tree whose leaves have a leading committee
axis, see :func:`petfunc.tree.stack`), every calculation also evaluates the
committee and gives ``energy_uncertainty``, ``forces_uncertainty`` and, for
periodic cells, ``stress_uncertainty``: the standard deviation over members
(``ddof=0``), component by component. The members' values are in
``energy_ensemble``, ``forces_ensemble``. The eager path evaluates the committee with
``torch.func.vmap``; the compiled path loops over members with the single compiled
function (inductor miscompiles some vmapped scatter/index ops on CPU,
pytorch/pytorch#183986).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
import torch
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes
from ase.data import chemical_symbols

from petfunc import allocator, tree
from petfunc.config import PETConfig
from petfunc.data.samples import padding_sample
from petfunc.derivatives import energy_terms_forces_strain_derivative
from petfunc.io.params import cast_params, load_params, network_dtype
from petfunc.model.long_range import calculator_backend, mesh_layout
from petfunc.model.pet import PET
from petfunc.remat import remat as remat_fn
from petfunc.structures import collate, prepare_atoms, state_from_info


__all__ = ["PETCalculator"]


def _symbol(z: int) -> str:
    return chemical_symbols[z] if 0 <= z < len(chemical_symbols) else f"Z={z}"


def _voigt(stress: np.ndarray) -> np.ndarray:
    """[..., 3, 3] -> [..., 6] in ASE order, off-diagonals symmetrised like metatomic."""
    s = stress
    return np.stack(
        [
            s[..., 0, 0],
            s[..., 1, 1],
            s[..., 2, 2],
            (s[..., 1, 2] + s[..., 2, 1]) / 2.0,
            (s[..., 0, 2] + s[..., 2, 0]) / 2.0,
            (s[..., 0, 1] + s[..., 1, 0]) / 2.0,
        ],
        axis=-1,
    )


def _charge_and_spin_info(info) -> list:
    """The charge and spin multiplicity a conditioned model reads from ``atoms.info``,
    as plain values (numpy arrays do not compare to one bool)."""
    return [None if v is None else np.asarray(v).tolist() for v in state_from_info(info)]


def partly_periodic_stress_warning(named: str | None = None) -> str:
    """The warning for a stress of structures (``named``, or "the system") that are
    not periodic in all three directions: metatomic's, whose volume it copies."""
    return (
        f"stress requested but likely to be wrong for {named or 'the system'}: not periodic in all "
        "directions (computed with the ASE cell volume, as metatomic does)"
    )


class PETCalculator(Calculator):
    """ASE calculator evaluating a petfunc PET (see the module docstring).

    Args:
        config: the architecture.
        params: parameter tree (e.g. from :func:`petfunc.load_params`). May be
            ``None`` when ``ensemble_params`` is given: the committee mean is then
            the prediction.
        compile: evaluate through :func:`petfunc.compile` (traced and compiled at the
            first calculation; later structures of any size reuse it).
        backend: ``torch.compile`` backend for ``compile=True``: ``"inductor"``
            (fast code, slow first call) or ``"aot_eager"`` (quick to compile).
        device: torch device of the computation (default: CPU).
        dtype: computation dtype (default: the dtype of the network weights).
        ensemble_params: optional committee: a parameter tree with a leading member
            axis on every leaf, or a list of parameter trees.
        exported: an :class:`petfunc.export.ExportedPET` (a ``petfunc export``
            artifact) evaluating the model instead of ``params``; see
            :meth:`from_exported`.
        llpr: LLPR uncertainty quantities of ``params`` (see :mod:`petfunc.llpr`;
            :meth:`from_metatrain` reads them from an LLPR checkpoint such as
            PET-MAD's): ``energy_uncertainty`` is then the calibrated LLPR standard
            deviation, and with ensemble weights ``energy_ensemble``,
            ``forces_ensemble``, ``forces_uncertainty`` and ``stress_uncertainty``
            come from the LLPR ensemble (compiled too with ``compile``; the
            members' forces only when one of the last three is asked for, as they
            cost one pullback per member).
        remat: recompute the transformer layers in the backward pass instead of
            keeping their activations (:func:`petfunc.remat`): the same numbers,
            about half the peak memory of a large system, at the cost of one more
            forward pass of the layers (plus glibc's page faults, below). Eager only
            (not with ``compile`` or ``exported``); applies to ``params``, not to a
            committee.
        keep_freed_memory: call :func:`petfunc.allocator.keep_freed_memory`, so that
            each step reuses the memory the last one freed instead of page-faulting
            it in again (process-wide; default: ``not remat``). For 1728 carbon
            atoms (eager, float32, 2 threads, ``benchmarks/memory.py``) a step took
            7.0 s instead of 23.4 s, with a peak resident size of 8.1 GiB instead of
            5.5 GiB (the heap keeps fragments). ``remat`` leaves it off by default: its memory saving would
            stay in the heap.
        **kwargs: passed to :class:`ase.calculators.calculator.Calculator`.
    """

    # what any calculator gives; an instance's own list adds the committee's or LLPR's
    # outputs when it has one (see ``__init__``)
    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress"]

    def __init__(
        self,
        config: PETConfig,
        params=None,
        compile: bool = False,
        backend: Any = "inductor",
        device=None,
        dtype: torch.dtype | None = None,
        ensemble_params=None,
        exported=None,
        llpr=None,
        remat: bool = False,
        keep_freed_memory: bool | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if isinstance(config, (str, os.PathLike)):
            raise TypeError(
                f"config must be a PETConfig, got the path {str(config)!r}: "
                "PETCalculator.from_checkpoint(path) loads a petfunc parameter file or checkpoint, "
                "PETCalculator.from_metatrain(path) a metatrain checkpoint, "
                "PETCalculator.from_exported(path) a petfunc export"
            )
        if not isinstance(config, PETConfig):
            raise TypeError(f"config must be a PETConfig, got {type(config).__name__}")
        if remat and (compile or exported is not None):
            raise ValueError(
                "remat recomputes layers through torch.autograd, so it needs the eager "
                "calculator: give it without compile=True and without an exported model"
            )
        if keep_freed_memory if keep_freed_memory is not None else not remat:
            allocator.keep_freed_memory()
        self.exported = exported
        if exported is not None:
            if params is not None or ensemble_params is not None or compile:
                raise ValueError(
                    "an exported model carries its own weights and code: give it without params, ensemble_params or compile"
                )
            if dtype is not None and dtype != exported.dtype:
                raise ValueError(
                    f"the exported model computes in {exported.dtype}, not {dtype}: its dtype is fixed "
                    "when it is written (petfunc export --dtype)"
                )
            device, dtype = exported.device, exported.dtype
            params = {}  # stands for the weights inside the artifact
        if params is None and ensemble_params is None:
            raise ValueError("PETCalculator needs params, ensemble_params or both")
        self.config = config
        self.model = PET(config)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if isinstance(ensemble_params, (list, tuple)):
            ensemble_params = tree.stack(ensemble_params)
        reference = params if params is not None else ensemble_params
        self.dtype = dtype or network_dtype(reference)
        self.params = None if params is None else cast_params(params, self.dtype, self.device)
        self.ensemble_params = ensemble_params
        self.compile = bool(compile)
        # GPUs on torch < 2.13: aot_eager for long-range models (long_range.calculator_backend)
        self.backend = calculator_backend(config, backend, self.device) if compile else backend
        self._remat = bool(remat)
        self._padding = padding_sample(config).structure
        self.llpr = None
        if llpr is not None:
            if params is None or ensemble_params is not None or exported is not None:
                raise ValueError("llpr needs params, and excludes ensemble_params and exported models")
            self.llpr = {k: v.to(dtype=self.dtype, device=self.device) for k, v in llpr.items()}
        self.implemented_properties = type(self).implemented_properties + _uncertainty_outputs(
            ensemble_params is not None, self.llpr
        )
        self._build_functions()

    def _build_functions(self) -> None:
        """The derivative functions (closures, rebuilt after unpickling) and empty
        caches of their compiled versions."""
        # energy, per-atom energies, forces, strain derivative: one forward pass;
        # traced (torch.func) when compiled, by autograd when eager (faster there)
        self._efs = energy_terms_forces_strain_derivative(self.model.energy_terms)
        terms = remat_fn(self.model.energy_terms) if self._remat else self.model.energy_terms
        self._efs_eager = energy_terms_forces_strain_derivative(terms, "autograd")
        # compiled functions by long-range mesh layout (long_range.mesh_layout): a
        # crystal and a molecule need one graph each with P3M, otherwise one in all
        self._compiled = {}
        if self.llpr is not None:
            from petfunc import llpr as llpr_module

            self._llpr_fns = {
                "offsets": llpr_module.ensemble_offsets(self.config, stress=True),
                "features": llpr_module.structure_features(self.config),
            }
            self._llpr_compiled = {}

    _FUNCTIONS = ("_efs", "_efs_eager", "_compiled", "_llpr_fns", "_llpr_compiled")

    def __getstate__(self):
        """Picklable (a ``multiprocessing`` pool of relaxations, say): the tensors and
        settings travel; the derivative functions are rebuilt, and a compiled
        calculator compiles again where it is unpickled (from the trace cache)."""
        if self.exported is not None:
            raise TypeError(
                "a PETCalculator of an exported model cannot be pickled: load the .pt2 file "
                "in each process (PETCalculator.from_exported)"
            )
        return {k: v for k, v in self.__dict__.items() if k not in self._FUNCTIONS}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._build_functions()

    # -- constructors ----------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, path, **kwargs) -> PETCalculator:
        """Calculator for a petfunc parameter file (:func:`petfunc.save_params`).

        A ``petfunc train`` checkpoint (plain data with ``"config"`` and ``"params"``
        / ``"best_params"``) is accepted too; its best parameters are used. For
        metatrain checkpoints and exported models use :meth:`from_metatrain`.
        """
        path = os.fspath(path)
        try:
            config, params = load_params(path)
        except ValueError as error:
            loaded = _training_checkpoint(path)
            if loaded is None:
                raise ValueError(
                    f"{error}. For a metatrain checkpoint (.ckpt) or an exported model "
                    "(.pt), use PETCalculator.from_metatrain."
                ) from error
            config, params = loaded
        return cls(config, params, **kwargs)

    @classmethod
    def from_metatrain(cls, path, target: str | None = None, **kwargs) -> PETCalculator:
        """Calculator for a metatrain PET checkpoint or exported metatomic model.

        Needs metatrain installed; see :func:`petfunc.from_metatrain`. An LLPR
        checkpoint (PET-MAD's) also gives its uncertainties (``llpr``); the file is
        read once.
        """
        from petfunc.io.params import _read_metatrain

        config, params, uncertainty = _read_metatrain(path, target=target, llpr="if present")
        return cls(config, params, llpr=uncertainty, **kwargs)

    @classmethod
    def from_exported(cls, path, aoti: bool | None = None, **kwargs) -> PETCalculator:
        """Calculator running a ``petfunc export`` artifact (``.pt2``).

        The model, its weights and its derivatives come from the file (the
        AOTInductor library when it has one, or with ``aoti=False`` the exported
        program); petfunc only builds the neighbour lists. See :mod:`petfunc.export`.
        """
        from petfunc.export.package import load

        exported = load(path, aoti=aoti)
        return cls(exported.config, exported=exported, **kwargs)

    # -- committee -------------------------------------------------------------------
    @property
    def ensemble_params(self):
        """The committee (leading member axis on every leaf), or ``None``.

        Settable: a compiled calculator evaluates a new committee of the same
        architecture without recompiling.
        """
        return self._ensemble_params

    @ensemble_params.setter
    def ensemble_params(self, value):
        if value is None:
            if getattr(self, "params", None) is None:
                raise ValueError("PETCalculator needs params, ensemble_params or both")
            self._ensemble_params, self.ensemble_size = None, 0
            self.reset()
            return
        if isinstance(value, (list, tuple)):
            value = tree.stack(value)
        sizes = {v.shape[0] if v.dim() else 0 for v in tree.flatten(value).values()}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError(
                "ensemble_params must have one leading (member) axis of the same, "
                f"non-zero size on every leaf; found sizes {sorted(sizes)}"
            )
        self._ensemble_params = cast_params(value, self.dtype, self.device)
        self.ensemble_size = sizes.pop()
        self.reset()

    # -- bookkeeping -----------------------------------------------------------------
    @property
    def num_compilations(self) -> int:
        """Graphs compiled so far (0 before the first compiled call or when eager)."""
        return sum(fn.num_graphs for fn in self._compiled.values())

    def _check_species(self, atoms) -> None:
        known = set(self.config.atomic_types)
        unknown = sorted({int(z) for z in atoms.numbers} - known)
        if unknown:
            names = ", ".join(f"{_symbol(z)} (Z={z})" for z in unknown)
            model = ", ".join(_symbol(z) for z in self.config.atomic_types)
            raise ValueError(
                f"the structure contains {names}, which this PET model does not know; "
                f"it was trained on {model}"
            )

    def _inputs(self, atoms):
        self._check_species(atoms)
        # a float32 model gets the atoms wrapped into the cell in float64: the same
        # result, without the digits an MD run's diffusion would cost it
        structure = prepare_atoms(atoms, self.config, label="atoms", wrap=self.dtype != torch.float64)
        # an exported long-range model may use Ewald sums instead of P3M
        method = getattr(self.exported, "long_range", None) or "p3m"
        # the dummy molecule keeps every size >= 2 (no 0/1 specialisation)
        return collate(
            [structure, self._padding], self.config, dtype=self.dtype, device=self.device, long_range=method
        )

    def _evaluate(self, params, inputs):
        positions, cell, neighbors = inputs
        if self.exported is not None:
            return self.exported(positions, cell, neighbors)
        if self.compile:
            layout = mesh_layout(neighbors.long_range)
            if layout not in self._compiled:
                from petfunc.compile import compile as petfunc_compile

                # the traced function is fixed by the config: later processes
                # load the trace instead of tracing again (petfunc.compile)
                self._compiled[layout] = petfunc_compile(
                    self._efs,
                    params,
                    positions,
                    cell,
                    neighbors,
                    backend=self.backend,
                    static_argnums=(0,),
                    cache_key=f"PETCalculator energy_terms_forces_strain_derivative {self.config!r}",
                    keep_freed_memory=False,  # decided by this object's own option
                    aot_autograd=True,  # AOTAutograd's cache: faster warm starts, which calculators mostly have
                )
            return self._compiled[layout](params, positions, cell, neighbors)
        return self._efs_eager(params, positions, cell, neighbors)

    def _evaluate_ensemble(self, inputs):
        positions, cell, neighbors = inputs
        if self.compile:
            members = [self._evaluate(p, inputs) for p in tree.unstack(self.ensemble_params)]
            return tuple(torch.stack(x) for x in zip(*members))
        fn = torch.func.vmap(self._efs, in_dims=(0, None, None, None))
        return fn(self.ensemble_params, positions, cell, neighbors)

    # -- ASE -------------------------------------------------------------------------
    def check_state(self, atoms, tol=1e-15):
        """ASE's changes, plus ``"info"`` when a conditioned model's charge or spin
        multiplicity in ``atoms.info`` changed (ASE does not compare ``info``)."""
        changes = super().check_state(atoms, tol)
        if self.config.system_conditioning and self.atoms is not None:
            if _charge_and_spin_info(self.atoms.info) != _charge_and_spin_info(atoms.info):
                changes.append("info")
        return changes

    def export_properties(self):
        """ASE's ``Properties`` of the results it knows (``atoms.get_properties``,
        socket I/O): the committee's and LLPR's results, such as
        ``energy_ensemble``, stay in ``results`` only (ASE refused the whole set)."""
        from ase.outputs import Properties, all_outputs

        return Properties({k: v for k, v in self.results.items() if k in all_outputs})

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        atoms = self.atoms
        n_atoms = len(atoms)
        volume = float(atoms.cell.volume)
        periodic = bool(np.all(atoms.pbc))
        if "stress" in properties:
            if volume <= 0.0:
                raise PropertyNotImplementedError(
                    "stress is undefined for this structure: its cell has zero volume "
                    f"(pbc={atoms.pbc.tolist()}); stress needs a periodic cell"
                )
            if not periodic:
                warnings.warn(partly_periodic_stress_warning(), stacklevel=2)
        want_stress = volume > 0.0 and (periodic or "stress" in properties)

        inputs = self._inputs(atoms)
        results = {}
        ensemble = None
        with torch.no_grad():
            if self.ensemble_params is not None:
                energies, per_atom, forces, strain = self._evaluate_ensemble(inputs)
                ensemble = (
                    energies[:, 0].double().cpu().numpy(),
                    forces[:, :n_atoms].double().cpu().numpy(),
                    strain[:, 0].double().cpu().numpy(),
                    per_atom[:, :n_atoms].double().cpu().numpy(),
                )
            if self.params is not None:
                energies, per_atom, forces, strain = self._evaluate(self.params, inputs)
                energy = energies[0].double().item()
                forces = forces[:n_atoms].double().cpu().numpy()
                strain = strain[0].double().cpu().numpy()
                per_atom = per_atom[:n_atoms].double().cpu().numpy()
            else:
                energy = float(ensemble[0].mean())
                forces = ensemble[1].mean(axis=0)
                strain = ensemble[2].mean(axis=0)
                per_atom = ensemble[3].mean(axis=0)
            results["energies"] = per_atom  # computed anyway: a later get_potential_energies costs nothing

            if self.llpr is not None:
                ensemble = self._llpr_results(inputs, n_atoms, results, energy, forces, strain, properties)

        results["energy"] = energy
        results["free_energy"] = energy
        results["forces"] = forces
        if want_stress:
            results["stress"] = _voigt(strain / volume)
        if ensemble is not None:
            results["energy_ensemble"] = ensemble[0]
            results["forces_ensemble"] = ensemble[1]
            results.setdefault("energy_uncertainty", float(ensemble[0].std()))
            results["forces_uncertainty"] = ensemble[1].std(axis=0)
            if want_stress:
                results["stress_uncertainty"] = _voigt(ensemble[2] / volume).std(axis=0)
        self.results = results

    def _llpr_results(self, inputs, n_atoms, results, energy, forces, strain, properties):
        """The LLPR uncertainty and member energies into ``results``; the members'
        forces and strain derivatives (K pullbacks) only when ``properties`` asks for
        ``forces_ensemble``, ``forces_uncertainty`` or ``stress_uncertainty``, then
        returned in the committee's form (else ``None``)."""
        from petfunc.llpr import uncertainty

        weights = self.llpr.get("ensemble_weights")
        if weights is not None and _LLPR_MEMBER_GRADIENTS & set(properties):
            features, d_energy, d_forces, d_strain = self._llpr_call("offsets", inputs)
            results["energy_uncertainty"] = float(uncertainty(self.llpr, features)[0])
            return (
                energy + d_energy[0].double().cpu().numpy(),
                forces[None] + d_forces[:, :n_atoms].double().cpu().numpy(),
                strain[None] + d_strain[:, 0].double().cpu().numpy(),
                None,
            )
        features = self._llpr_call("features", inputs)
        results["energy_uncertainty"] = float(uncertainty(self.llpr, features)[0])
        if weights is not None:
            delta = weights - weights.mean(dim=0, keepdim=True)
            results["energy_ensemble"] = energy + (features[0] @ delta.T).double().cpu().numpy()
        return None

    def _llpr_call(self, name: str, inputs):
        """An LLPR function on ``inputs``: eager, or with ``compile`` through
        :func:`petfunc.compile` (one graph each, compiled at first use)."""
        positions, cell, neighbors = inputs
        if name == "features":
            fn, args, static = self._llpr_fns[name], (self.params, positions, cell, neighbors), (0,)
        else:
            fn, args, static = (
                self._llpr_fns[name],
                (self.params, self.llpr, positions, cell, neighbors),
                (0, 1),
            )
        if not self.compile:
            return fn(*args)
        if name not in self._llpr_compiled:
            from petfunc.compile import compile as petfunc_compile

            members = self.llpr["ensemble_weights"].shape[0] if "ensemble_weights" in self.llpr else 0
            self._llpr_compiled[name] = petfunc_compile(
                fn,
                *args,
                backend=self.backend,
                static_argnums=static,
                cache_key=f"PETCalculator LLPR {name} {self.config!r} members={members}",
                keep_freed_memory=False,  # decided by this object's own option
                aot_autograd=True,  # AOTAutograd's cache: faster warm starts, which calculators mostly have
            )
        return self._llpr_compiled[name](*args)


_LLPR_MEMBER_GRADIENTS = {"forces_ensemble", "forces_uncertainty", "stress_uncertainty"}


def _uncertainty_outputs(committee: bool, llpr) -> list:
    """The uncertainty outputs of a calculator with a committee or LLPR weights."""
    if committee or (llpr is not None and "ensemble_weights" in llpr):
        return [
            "energy_uncertainty",
            "forces_uncertainty",
            "stress_uncertainty",
            "energy_ensemble",
            "forces_ensemble",
        ]
    return ["energy_uncertainty"] if llpr is not None else []


def _training_checkpoint(path):
    """``(config, params)`` of a petfunc training checkpoint, or ``None``.

    A training checkpoint (``petfunc train``, format ``"petfunc.checkpoint"``) is a
    plain-data ``torch.save`` with a ``config`` (JSON string or hypers dict) and
    ``params`` / ``best_params`` (``{dotted.name: tensor}`` or a tree); the best
    parameters are used when present, as metatrain's export does.
    """
    import json

    from petfunc.io.params import check_params

    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return None
    if not isinstance(payload, dict) or "config" not in payload:
        return None
    params = payload.get("best_params") or payload.get("params")
    if not isinstance(params, dict):
        return None
    hypers = payload["config"]
    if isinstance(hypers, str):
        hypers = json.loads(hypers)
    config = PETConfig.from_hypers(hypers)
    if any(isinstance(k, str) and "." in k for k in params):
        params = tree.unflatten(dict(params))
    check_params(config, params, what=f"the parameters in {path!r}")
    return config, params
