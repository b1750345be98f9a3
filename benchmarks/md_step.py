"""One MD step (energy + forces + stress) through ASE: metatomic vs petfunc, same weights.

Compares, per MD-like step (positions rattled every step, so neighbour lists must be
rebuilt), three ASE calculators running the same PET weights (the default PET
architecture, petfunc's seed-0 init copied into metatrain; float32 by default):

* ``metatomic``: ``metatomic_ase.MetatomicCalculator`` on metatrain's exported
  ``AtomisticModel`` (TorchScript; its own vesin Verlet list with ``--skin``, 2 Å by
  default as in metatomic);
* ``petfunc eager``: ``petfunc.ase.PETCalculator`` (torch.func, vesin every step);
* ``petfunc compiled``: the same with ``compile=True`` (``petfunc.compile``, inductor).
  It is traced and compiled once, on the first system, and then serves every system
  size: the script prints the compile time and the number of compilations (1);
* ``petfunc AOTI`` (with ``--export``): ``PETCalculator.from_exported`` on the
  ``petfunc export`` artifact (torch.export + AOTInductor, no Python model code);
  the script prints the export time.

Systems: ethanol (9 atoms, energy + forces), diamond carbon 2x2x2 (64 atoms) and
4x4x4 (512 atoms) conventional supercells (energy + forces + stress). Timings are
interleaved (A B C A B C ...) after warm-up calls and reported as medians, with the
ratio metatomic / petfunc and the growth of the cost with the number of atoms. The
outputs are compared (max abs difference against metatomic).

Run from the repository root on a quiet machine:

    python benchmarks/md_step.py                       # 20 repeats, float32
    python benchmarks/md_step.py --repeats 50 --threads 8
    python benchmarks/md_step.py --quick               # 3 repeats (a smoke run)
    python benchmarks/md_step.py --no-compile          # skip the inductor compile
    python benchmarks/md_step.py --export              # add the AOTInductor artifact
    python benchmarks/md_step.py --long-range          # PET with long-range features

With ``--long-range`` the metatomic column's numbers differ from petfunc's by about
1e-4 eV: metatrain pairs its sorted edge lengths with the unsorted pairs of
metatomic's Verlet list in the real-space Coulomb term (see the README).

Needs metatrain and metatomic-ase (``pip install 'petfunc[metatrain]'``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ase.build
from _measure import add_malloc_option, apply_malloc

import petfunc
from petfunc.ase import PETCalculator
from petfunc.structures import prepare_atoms


PROPERTIES_MOLECULE = ["energy", "forces"]
PROPERTIES_PERIODIC = ["energy", "forces", "stress"]


# ---------------------------------------------------------------------------------------
# systems


def ethanol():
    atoms = ase.build.molecule("CH3CH2OH")
    atoms.rattle(0.05, seed=0)
    return atoms


def diamond(repeat: int):
    atoms = ase.build.bulk("C", "diamond", a=3.567, cubic=True).repeat((repeat,) * 3)
    atoms.rattle(0.05, seed=0)
    return atoms


SYSTEMS = {
    "ethanol": ethanol,
    "C64": lambda: diamond(2),
    "C512": lambda: diamond(4),
}


# ---------------------------------------------------------------------------------------
# calculators


def metatomic_calculator(config, params, dtype, skin):
    from metatomic_ase import MetatomicCalculator
    from metatrain.pet import PET as MetatrainPET
    from metatrain.utils.architectures import get_default_hypers
    from metatrain.utils.data import DatasetInfo
    from metatrain.utils.data.target_info import get_energy_target_info

    hypers = copy.deepcopy(get_default_hypers("pet")["model"])
    for key, value in config.to_hypers().items():
        if key == "long_range":
            hypers["long_range"].update(value)
        elif key != "atomic_types":
            hypers[key] = value
    targets = {"energy": get_energy_target_info("energy", {"quantity": "energy", "unit": "eV"})}
    info = DatasetInfo(length_unit="angstrom", atomic_types=list(config.atomic_types), targets=targets)
    model = MetatrainPET(hypers, info).to(dtype)
    state = petfunc.io.to_metatrain_state_dict(params, config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(not k.startswith("backend.") for k in missing), (missing, unexpected)
    # petfunc's init has composition 0 and scale 1, as a fresh metatrain model
    return MetatomicCalculator(model.eval().export(), device="cpu", neighbor_skin=skin)


def evaluate(calc, atoms, properties):
    """One ASE calculation from scratch; returns (energy, forces, stress or None)."""
    calc.calculate(atoms, properties, ["positions"])
    results = calc.results
    stress = results.get("stress") if "stress" in properties else None
    return results["energy"], results["forces"], stress


# ---------------------------------------------------------------------------------------
# timing


def run_system(name, atoms, calculators, repeats, warmup, rattle, seed):
    properties = PROPERTIES_PERIODIC if atoms.pbc.all() else PROPERTIES_MOLECULE
    reference = atoms.get_positions()
    rng = np.random.default_rng(seed)
    times = {label: [] for label in calculators}
    diffs = {label: np.zeros(3) for label in calculators}  # energy, forces, stress
    for step in range(warmup + repeats):
        # a new geometry every step, the same one for every calculator
        atoms.set_positions(reference + rng.normal(scale=rattle, size=reference.shape))
        outputs = {}
        for label, calc in calculators.items():
            frame = atoms.copy()
            start = time.perf_counter()
            outputs[label] = evaluate(calc, frame, properties)
            elapsed = time.perf_counter() - start
            if step >= warmup:
                times[label].append(elapsed)
        base = outputs["metatomic"]
        for label, out in outputs.items():
            d = [abs(out[0] - base[0]), np.abs(out[1] - base[1]).max(), 0.0]
            if out[2] is not None:
                d[2] = np.abs(out[2] - base[2]).max()
            diffs[label] = np.maximum(diffs[label], d)
    atoms.set_positions(reference)
    return {label: statistics.median(t) for label, t in times.items()}, diffs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per system")
    parser.add_argument("--quick", action="store_true", help="3 repeats, 1 warm-up")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--skin", type=float, default=2.0, help="metatomic's neighbour-list skin (A)")
    parser.add_argument("--rattle", type=float, default=0.02, help="displacement std per step (A)")
    parser.add_argument("--no-compile", action="store_true", help="skip petfunc compiled (inductor)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument(
        "--export", action="store_true", help="add petfunc's AOTInductor artifact (petfunc export)"
    )
    parser.add_argument(
        "--long-range",
        action="store_true",
        help="PET with long-range features (P3M/direct, torch-pme's defaults)",
    )
    add_malloc_option(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup = 3, 1
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    apply_malloc(args)
    dtype = getattr(torch, args.dtype)

    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), long_range={"enable": args.long_range})
    params = petfunc.init(config, seed=0, dtype=dtype)
    keep = args.malloc == "keep"  # the calculator would keep freed memory by default
    calculators = {
        "metatomic": metatomic_calculator(config, params, dtype, args.skin),
        "petfunc eager": PETCalculator(config, params, dtype=dtype, keep_freed_memory=keep),
    }
    compiled = None
    if not args.no_compile:
        compiled = PETCalculator(
            config, params, dtype=dtype, compile=True, backend=args.backend, keep_freed_memory=keep
        )
        calculators["petfunc compiled"] = compiled

    print(
        f"PET default architecture ({petfunc.tree.count(params)} parameters), {args.dtype}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, malloc {args.malloc}, "
        f"{args.repeats} timed steps per system after {args.warmup} warm-up"
    )
    if compiled is not None:
        atoms = SYSTEMS[args.systems[0]]()
        start = time.perf_counter()
        evaluate(compiled, atoms, PROPERTIES_PERIODIC if atoms.pbc.all() else PROPERTIES_MOLECULE)
        print(f"petfunc compile ({args.backend}, trace + first call): {time.perf_counter() - start:.1f} s")

    if args.export:
        import tempfile

        from petfunc.export.package import export

        scratch = tempfile.mkdtemp(prefix="petfunc-md-export-")
        start = time.perf_counter()
        path = export(config, params, Path(scratch) / "model.pt2", dtype=dtype)
        print(f"petfunc export (torch.export + AOTInductor): {time.perf_counter() - start:.1f} s")
        calculators["petfunc AOTI"] = PETCalculator.from_exported(path, keep_freed_memory=keep)

    rows, edges = [], {}
    for name in args.systems:
        atoms = SYSTEMS[name]()
        medians, diffs = run_system(name, atoms, calculators, args.repeats, args.warmup, args.rattle, 0)
        rows.append((name, len(atoms), medians, diffs))
        edges[name] = len(prepare_atoms(atoms, config).centers) / len(atoms)

    labels = list(calculators)
    print()
    header = f"{'system':<8} {'atoms':>5} {'nbrs':>5} " + " ".join(
        f"{label + ' (ms)':>22}" for label in labels
    )
    header += " " + " ".join(f"{'mta/' + label.split()[-1]:>12}" for label in labels[1:])
    print(header)
    for name, n, medians, _ in rows:
        line = f"{name:<8} {n:>5} {edges[name]:>5.1f} " + " ".join(
            f"{1e3 * medians[label]:>22.2f}" for label in labels
        )
        line += " " + " ".join(f"{medians['metatomic'] / medians[label]:>12.2f}" for label in labels[1:])
        print(line)

    print("(nbrs: neighbours within the cutoff per atom; the cost grows with atoms x nbrs)")
    print("\ncost growth (time per atom, us; ratio of times between consecutive sizes / atom ratio)")
    for label in labels:
        parts = [f"{name}: {1e6 * medians[label] / n:.0f}" for name, n, medians, _ in rows]
        growth = []
        for (n0, m0), (n1, m1) in zip([(r[1], r[2]) for r in rows[:-1]], [(r[1], r[2]) for r in rows[1:]]):
            growth.append(f"x{m1[label] / m0[label]:.1f} for x{n1 / n0:.1f} atoms")
        print(f"  {label:<17} " + ", ".join(parts) + ("   (" + "; ".join(growth) + ")" if growth else ""))

    print("\nmax |difference| to metatomic over all steps: energy (eV), forces (eV/A), stress (eV/A^3)")
    for name, _, _, diffs in rows:
        print(
            f"  {name:<8} "
            + "; ".join(f"{label}: " + " ".join(f"{x:.1e}" for x in diffs[label]) for label in labels[1:])
        )
    if compiled is not None:
        print(f"\npetfunc compiled: {compiled.num_compilations} compilation(s) for all systems")


if __name__ == "__main__":
    main()
