"""An ASE calculator for PET: :class:`PETCalculator` (conventions: :mod:`petfunc.ase`).

Every calculation evaluates energy, per-atom energies, forces and the strain
derivative in one call of ``energy_terms_forces_strain_derivative(model.energy_terms)``:
eagerly (by ``torch.autograd``, the faster eager path, :mod:`petfunc.derivatives`),
or, with ``compile=True``, through :func:`petfunc.compile` (one ``make_fx`` trace of
the ``torch.func`` derivative, compiled for symbolic sizes; the trace is cached on
disk, so a later process with the same config skips it), or in a ``petfunc export``
artifact (:meth:`PETCalculator.from_exported`). The structure is batched together
with :func:`petfunc.structures.padding_structure` (a 3-atom molecule), so that no size
the compiled graph sees (structures, atoms, edges, neighbours per atom) is 0 or 1;
the number of edges changing from one MD step to the next never recompiles
(``num_compilations`` stays 1).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from ase.calculators.calculator import Calculator, all_changes
from ase.outputs import Properties, all_outputs

from petfunc import allocator, tree
from petfunc.ase.llpr import LLPRResults
from petfunc.ase.results import (
    charge_and_spin_info,
    committee_arrays,
    model_arrays,
    results,
    stress_wanted,
    symbol,
    uncertainty_outputs,
)
from petfunc.compile import compile as compile_function
from petfunc.config import PETConfig
from petfunc.derivatives import energy_terms_forces_strain_derivative
from petfunc.export import load as load_exported
from petfunc.graph import mesh_layout
from petfunc.io import cast_params, load_params, network_dtype
from petfunc.io.checkpoint import is_checkpoint
from petfunc.io.digest import DamagedFileError
from petfunc.io.load import load_model, torch_payload
from petfunc.io.metatrain import read_metatrain
from petfunc.model import PET
from petfunc.model.long_range import calculator_backend
from petfunc.remat import remat as remat_fn
from petfunc.structures import collate_padded, prepare_atoms


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
                    "an exported model carries its own weights and code: give it without params, "
                    "ensemble_params or compile"
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
        self.llpr = None
        if llpr is not None:
            if params is None or ensemble_params is not None or exported is not None:
                raise ValueError("llpr needs params, and excludes ensemble_params and exported models")
            self.llpr = {k: v.to(dtype=self.dtype, device=self.device) for k, v in llpr.items()}
        self.implemented_properties = type(self).implemented_properties + uncertainty_outputs(
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
        self._llpr = (
            None if self.llpr is None else LLPRResults(self.config, self.llpr, self.compile, self.backend)
        )

    _FUNCTIONS = ("_efs", "_efs_eager", "_compiled", "_llpr")

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

        A ``petfunc train`` checkpoint is accepted too; its best parameters are used
        (LoRA adapters merged). For
        metatrain checkpoints and exported models use :meth:`from_metatrain`.
        """
        path = os.fspath(path)
        try:
            config, params = load_params(path)
        except DamagedFileError:
            raise  # it says which file to use instead
        except ValueError as error:
            payload, _ = torch_payload(path)
            if not is_checkpoint(payload):
                raise ValueError(
                    f"{str(error).rstrip('.')}. For a metatrain checkpoint (.ckpt) or an exported model "
                    "(.pt), use PETCalculator.from_metatrain."
                ) from error
            config, params = load_model(path, which="best")
        return cls(config, params, **kwargs)

    @classmethod
    def from_metatrain(cls, path, target: str | None = None, **kwargs) -> PETCalculator:
        """Calculator for a metatrain PET checkpoint or exported metatomic model.

        Needs metatrain installed; see :func:`petfunc.from_metatrain`. An LLPR
        checkpoint (PET-MAD's) also gives its uncertainties (``llpr``); the file is
        read once.
        """
        config, params, uncertainty = read_metatrain(path, target=target, llpr="if present")
        return cls(config, params, llpr=uncertainty, **kwargs)

    @classmethod
    def from_exported(cls, path, aoti: bool | None = None, **kwargs) -> PETCalculator:
        """Calculator running a ``petfunc export`` artifact (``.pt2``).

        The model, its weights and its derivatives come from the file; petfunc only
        builds the neighbour lists. ``aoti`` as in :func:`petfunc.export.load`: an
        AOTInductor library is native code, loaded by default only from a file this
        machine exported (``aoti=True`` trusts any file; ``False`` runs the exported
        program). See :mod:`petfunc.export`.
        """
        exported = load_exported(path, aoti=aoti)
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
            names = ", ".join(f"{symbol(z)} (Z={z})" for z in unknown)
            model = ", ".join(symbol(z) for z in self.config.atomic_types)
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
        # the padding molecule keeps every size >= 2 (no 0/1 specialisation)
        positions, cell, neighbors, _ = collate_padded(
            [structure], self.config, always=True, dtype=self.dtype, device=self.device, long_range=method
        )
        return positions, cell, neighbors

    def _evaluate(self, params, inputs):
        positions, cell, neighbors = inputs
        if self.exported is not None:
            return self.exported(positions, cell, neighbors)
        if self.compile:
            layout = mesh_layout(neighbors.long_range)
            if layout not in self._compiled:
                # the traced function is fixed by the config: later processes
                # load the trace instead of tracing again (petfunc.compile)
                self._compiled[layout] = compile_function(
                    self._efs,
                    params,
                    positions,
                    cell,
                    neighbors,
                    backend=self.backend,
                    static_argnums=(0,),
                    cache_key=f"PETCalculator energy_terms_forces_strain_derivative {self.config!r}",
                    keep_freed_memory=False,  # decided by this object's own option
                    aot_autograd=True,  # AOTAutograd's cache: calculators mostly start warm
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
            if charge_and_spin_info(self.atoms.info) != charge_and_spin_info(atoms.info):
                changes.append("info")
        return changes

    def export_properties(self):
        """ASE's ``Properties`` of the results it knows (``atoms.get_properties``,
        socket I/O): the committee's and LLPR's results, such as
        ``energy_ensemble``, stay in ``results`` only (ASE refused the whole set)."""
        return Properties({k: v for k, v in self.results.items() if k in all_outputs})

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        atoms = self.atoms
        n_atoms = len(atoms)
        want_stress = stress_wanted(atoms, properties)
        inputs = self._inputs(atoms)
        ensemble = None
        with torch.no_grad():
            if self.ensemble_params is not None:
                ensemble = committee_arrays(self._evaluate_ensemble(inputs), n_atoms)
            if self.params is not None:
                energy, per_atom, forces, strain = model_arrays(self._evaluate(self.params, inputs), n_atoms)
            else:
                energy = float(ensemble[0].mean())
                forces, strain, per_atom = (part.mean(axis=0) for part in ensemble[1:])
            partial = {"energies": per_atom}  # computed anyway: a later get_potential_energies costs nothing
            if self.llpr is not None:
                ensemble = self._llpr(
                    self.params, inputs, n_atoms, partial, energy, forces, strain, properties
                )
        volume = float(atoms.cell.volume) if want_stress else None
        self.results = results(partial, energy, forces, strain, ensemble, volume)
