"""Energy + forces + stress: petfunc (eager) against metatrain's eager PET.

Both run the same weights (the default PET architecture, petfunc's seed-0 init copied
into metatrain) on the same structures, in evaluation mode. metatrain's forces and
stress come from autograd through an identity strain, as metatomic computes them.
The integer neighbour data are built once outside the timed region for both
("model" rows); the "+ neighbour list" rows also rebuild them on every call.

Timings interleave the two implementations (A B A B ...) after a warm-up and report
medians. Run from the repository root:

    python benchmarks/energy_forces.py                # float32 and float64
    python benchmarks/energy_forces.py --repeats 20 --threads 1 --dtype float32
    python benchmarks/energy_forces.py --autodiff autograd   # petfunc by torch.autograd

petfunc differentiates with ``torch.func`` by default (``--autodiff func``), or with
``torch.autograd`` as metatrain does (``--autodiff autograd``, what petfunc's eager
trainer and ASE calculator use).

Needs metatrain (``pip install 'petfunc[metatrain]'``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ase
import ase.build
import ase.io

import petfunc


DATA = Path(__file__).resolve().parents[1] / "../shared/data"


# ---------------------------------------------------------------------------------------
# structures


def ethanol_molecules(n: int):
    path = DATA / "ethanol_reduced_100.xyz"
    if path.is_file():
        frames = ase.io.read(path, index=f":{n}")
    else:
        frames = []
        for i in range(n):
            atoms = ase.build.molecule("CH3CH2OH")
            atoms.rattle(0.05, seed=i)
            frames.append(atoms)
    for atoms in frames:
        atoms.calc = None
        atoms.info.clear()
        atoms.arrays = {k: v for k, v in atoms.arrays.items() if k in ("numbers", "positions")}
    return frames


def carbon_supercell():
    """64 atoms: the 8-atom cubic diamond cell repeated 2 x 2 x 2, rattled."""
    atoms = ase.build.bulk("C", "diamond", a=3.567, cubic=True).repeat((2, 2, 2))
    atoms.rattle(0.05, seed=0)
    return atoms


# ---------------------------------------------------------------------------------------
# metatrain


def metatrain_model(config: petfunc.PETConfig, params, dtype):
    from metatrain.pet import PET as MetatrainPET
    from metatrain.utils.architectures import get_default_hypers
    from metatrain.utils.data import DatasetInfo
    from metatrain.utils.data.target_info import get_energy_target_info

    hypers = copy.deepcopy(get_default_hypers("pet")["model"])
    for key, value in config.to_hypers().items():
        if key not in ("atomic_types", "long_range"):
            hypers[key] = value
    targets = {"energy": get_energy_target_info("energy", {"quantity": "energy", "unit": "eV"})}
    info = DatasetInfo(length_unit="angstrom", atomic_types=list(config.atomic_types), targets=targets)
    model = MetatrainPET(hypers, info).to(dtype)  # before loading: no float32 rounding
    state = petfunc.io.to_metatrain_state_dict(params, config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(not k.startswith("backend.") for k in missing), (missing, unexpected)
    # petfunc's init has composition 0 and scale 1, as a fresh metatrain model
    return model.eval()


class MetatrainRunner:
    """Energy, forces and stress of a batch with metatrain, as metatomic computes them."""

    def __init__(self, model, frames, dtype):
        from metatomic.torch import ModelOutput, systems_to_torch
        from metatrain.utils.neighbor_lists import (
            get_requested_neighbor_lists,
            get_system_with_neighbor_lists,
        )

        self.model = model
        self.frames = frames
        self.dtype = dtype
        self.requested = get_requested_neighbor_lists(model)
        self.outputs = {"energy": ModelOutput(unit="eV", sample_kind="system")}
        self.base = [
            get_system_with_neighbor_lists(s, self.requested) for s in systems_to_torch(frames, dtype=dtype)
        ]
        self._systems_to_torch = systems_to_torch
        self._with_lists = get_system_with_neighbor_lists

    def __call__(self, rebuild_lists: bool = False):
        from metatomic.torch import System

        bases = self.base
        if rebuild_lists:
            bases = [
                self._with_lists(s, self.requested)
                for s in self._systems_to_torch(self.frames, dtype=self.dtype)
            ]
        positions, strains, systems = [], [], []
        for base in bases:
            strain = torch.eye(3, dtype=self.dtype, requires_grad=True)
            pos = base.positions.detach().clone().requires_grad_(True)
            system = System(types=base.types, positions=pos @ strain, cell=base.cell @ strain, pbc=base.pbc)
            for options in base.known_neighbor_lists():
                system.add_neighbor_list(options, base.get_neighbor_list(options))
            positions.append(pos)
            strains.append(strain)
            systems.append(system)
        energy = self.model(systems, self.outputs)["energy"].block().values[:, 0]
        grads = torch.autograd.grad(energy.sum(), positions + strains)
        forces = -torch.cat(grads[: len(systems)])
        stress = []
        for base, g in zip(bases, grads[len(systems) :]):
            volume = torch.abs(torch.det(base.cell)) if bool(base.pbc.all()) else torch.tensor(float("nan"))
            stress.append(g / volume)
        return energy.detach(), forces, torch.stack(stress)


class PetfuncRunner:
    def __init__(self, config, params, frames, dtype, autodiff="func"):
        self.config, self.params, self.frames, self.dtype = config, params, frames, dtype
        self.fn = petfunc.energy_forces_stress(petfunc.PET(config).energy, autodiff)
        self.inputs = petfunc.from_atoms(frames, config, dtype=dtype)

    def __call__(self, rebuild_lists: bool = False):
        inputs = (
            petfunc.from_atoms(self.frames, self.config, dtype=self.dtype) if rebuild_lists else self.inputs
        )
        return self.fn(self.params, *inputs)


# ---------------------------------------------------------------------------------------
# timing


def interleaved(a, b, repeats: int, warmup: int = 2):
    for _ in range(warmup):
        a()
        b()
    ta, tb = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        a()
        ta.append(time.perf_counter() - start)
        start = time.perf_counter()
        b()
        tb.append(time.perf_counter() - start)
    return statistics.median(ta), statistics.median(tb)


def check_agreement(mtt, pft, dtype):
    e0, f0, s0 = mtt()
    e1, f1, s1 = pft()
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    rel_e = float((e0 - e1).abs().max() / e0.abs().max())
    rel_f = float((f0 - f1).abs().max() / f0.abs().max())
    finite = torch.isfinite(s0)
    rel_s = float((s0[finite] - s1[finite]).abs().max() / s0[finite].abs().max()) if finite.any() else 0.0
    if max(rel_e, rel_f, rel_s) > tol:
        raise RuntimeError(
            f"petfunc and metatrain disagree: energy {rel_e:.1e}, forces {rel_f:.1e}, stress {rel_s:.1e}"
        )
    return max(rel_e, rel_f, rel_s)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", choices=["float32", "float64", "both"], default="both")
    parser.add_argument("--batch", type=int, default=16, help="ethanol molecules in the batch case")
    parser.add_argument(
        "--autodiff", choices=["func", "autograd"], default="func", help="petfunc's derivative path"
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)

    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8))
    params64 = petfunc.PET(config).init(seed=0, dtype=torch.float64)
    cases = [
        ("ethanol", ethanol_molecules(1)),
        (f"ethanol x{args.batch}", ethanol_molecules(args.batch)),
        ("C64 diamond (periodic)", [carbon_supercell()]),
    ]
    dtypes = [torch.float32, torch.float64] if args.dtype == "both" else [getattr(torch, args.dtype)]

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), default PET "
        f"({petfunc.tree.count(params64)} parameters), median of {args.repeats}, interleaved; "
        f"petfunc autodiff={args.autodiff}"
    )
    header = f"{'structures':<24} {'atoms':>5} {'dtype':>7} {'what':<16} {'metatrain ms':>12} {'petfunc ms':>11} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for dtype in dtypes:
        params = petfunc.tree.tree_map(lambda t: t.to(dtype), params64)
        model = metatrain_model(config, params64, dtype)
        for name, frames in cases:
            mtt = MetatrainRunner(model, frames, dtype)
            pft = PetfuncRunner(config, params, frames, dtype, args.autodiff)
            check_agreement(mtt, pft, dtype)
            n_atoms = sum(len(a) for a in frames)
            for label, rebuild in (("model", False), ("+ neighbour list", True)):
                t_mtt, t_pft = interleaved(lambda: mtt(rebuild), lambda: pft(rebuild), args.repeats)
                print(
                    f"{name:<24} {n_atoms:>5} {str(dtype)[6:]:>7} {label:<16} "
                    f"{1e3 * t_mtt:>12.1f} {1e3 * t_pft:>11.1f} {t_mtt / t_pft:>6.2f}"
                )
    print("ratio = metatrain time / petfunc time (> 1: petfunc is faster)")


if __name__ == "__main__":
    main()
