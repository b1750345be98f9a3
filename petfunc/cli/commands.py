"""The ``petfunc`` command: ``petfunc train``, ``petfunc eval`` and ``petfunc export``.

Usage (``petfunc COMMAND --help`` lists every flag)::

    petfunc train [OPTIONS.yaml] [--output DIR] [--restart CKPT] [--epochs N]
                  [--batch-size N] [--lr X] [--seed N] [--dtype float32|float64]
                  [--device cpu|cuda] [--compile | --no-compile]
                  [--backend inductor|aot_eager|eager] [--remat]
                  [--deterministic | --nondeterministic] [--no-augmentation]
                  [--finetune MODEL] [--finetune-method full|heads|lora]
                  [--structures N] [--no-progress] [--threads N] [--set KEY=VALUE ...]
    petfunc eval MODEL DATASET.xyz [--batch-size N] [--dtype ...] [--energy-key K] ...
                  [--output PREDICTIONS.xyz] [--json METRICS.json]
    petfunc export MODEL OUT.pt2 [--dtype ...] [--device ...] [--aoti | --no-aoti]

``python -m petfunc`` is the same command.

``petfunc train`` without an options file is a demo that runs in about a minute on
a laptop CPU (on a busy machine, ``--threads 1`` can be several times faster than
torch's default thread count): it writes a built-in dataset (``dataset.xyz``, 160 rattled and
strained periodic fcc Cu/Al/Ni alloy cells of 8, 12, 16 and 32 atoms, with EMT
energies, forces and stresses from ASE) to the output folder and trains the demo
model on it (:data:`DEMO_OPTIONS`: PET with ``d_pet=32``, ``d_node=64``,
``d_head=32``, ``d_feedforward=64``, 4 heads, 1 attention layer per GNN layer, 2 GNN
layers, cutoff 4.5 Å; 106k parameters; 20 epochs of batch 8 at learning rate 3e-3,
float32, metatrain's default loss: energy, forces and stress, all weight 1).

Without an options file but with ``--set training_set=FILE``, the demo's options
train on that file instead of the built-in dataset.

Outputs (in ``--output``, default ``outputs/YYYY-MM-DD/HH-MM-SS``): ``options.yaml``
(the complete options used; ``petfunc train DIR/options.yaml`` reruns),
``last.ckpt`` and ``best.ckpt`` (see :mod:`petfunc.trainer`; ``--restart`` takes
either), ``epoch_N.ckpt`` every ``checkpoint_interval`` epochs, ``best_params.pt``
(:func:`petfunc.save_params`), ``metrics.csv`` (one row per epoch), ``parity.png``
(and ``parity_test.png`` with a test set), and ``dataset.xyz`` for the demo. A run
that stops before its first checkpoint removes the folder it made (or restores the
one it was given); one stopped by a NaN loss keeps its ``options.yaml``.

Options file schema
-------------------

The layout of metatrain's ``options.yaml`` (``examples/options.yaml`` shows every
key). Unknown keys raise an error naming them. Defaults are metatrain's.

.. code-block:: yaml

    seed: 0                       # all randomness: split, init, shuffling, rotations
    base_precision: 32            # 32 (float32) or 64 (float64)
    device: cpu                   # cpu, cuda or cuda:N
    architecture:
      name: pet
      atomic_types: [13, 28, 29]  # optional; default: every element in the data
      model:                      # PETConfig fields (metatrain's PET model hypers);
        cutoff: 4.5               # omitted ones take metatrain's defaults
        d_pet: 128
        # ... d_head, d_node, d_feedforward, num_heads, num_attention_layers,
        #     num_gnn_layers, cutoff_width, cutoff_function, normalization,
        #     activation, transformer_type, featurizer_type, zbl,
        #     num_neighbors_adaptive, system_conditioning (charge/spin,
        #     with max_charge and max_spin_multiplicity), ...
      training:
        batch_size: 16            # per process (torchrun: N processes train on N*16)
        num_epochs: 1000
        learning_rate: 1.0e-4     # peak of warm-up + cosine decay, stepped per batch
        warmup_fraction: 0.01     # of all optimizer steps
        weight_decay: null        # null: Adam; a number: AdamW
        grad_clip_norm: 1.0       # global norm; null: no clipping
        loss: mse                 # mse | mae | huber for every term, or per term:
        #  loss:
        #    energy:               # (or the energy target's own name, mtt::U0)
        #      type: mse
        #      weight: 1.0
        #      reduction: mean       # mean | sum over the batch's labels (per term)
        #      gradients:          # or forces/stress/virial directly under energy
        #        positions: {type: mse, weight: 10.0}     # forces
        #        strain: {type: mse, weight: 1.0}         # stress or virial
        best_model_metric: mae_prod   # mae_prod | rmse_prod (validation errors of every labelled
                                      # quantity, weight 0 too) | loss (of the whole validation set)
        log_interval: 1           # print a line every N epochs (validation: every epoch)
        checkpoint_interval: 100  # also keep epoch_N.ckpt every N epochs
        scale_targets: true       # fit the energy scale (false: scale 1 eV)
        finetune:
          read_from: null         # start from a checkpoint: petfunc .ckpt / params
                                  # file, or a metatrain .ckpt / model.pt
          method: full            # full | heads (readout only) | lora (adapters)
          # config:               # heads; empty: metatrain's default below
          #   head_modules: [node_heads, edge_heads]
          #   last_layer_modules: [node_last_layers, edge_last_layers]
          # config:               # lora (metatrain's defaults)
          #   rank: 4
          #   alpha: 8
          #   target_modules: [input_linear, output_linear]
          inherit_heads: {}       # {energy: NAME}: start the heads from target NAME
                                  # of a metatrain checkpoint with several targets
        # petfunc additions:
        augmentation: true        # random O(3) rotations of training structures
        compile: false            # trace + torch.compile the train and eval steps
        compile_backend: inductor # inductor | aot_eager | eager
        remat: false              # recompute layers in the backward pass: less
                                  # memory for energy-only losses, more time
                                  # (eager steps only)
        deterministic: null       # fixed-order float sums in scatter-adds: the same
                                  # options, threads and device give the same run;
                                  # null: on CPU only
    training_set:                 # or just a file name: training_set: data.xyz
      systems:
        read_from: data.xyz       # anything ase.io.read reads (extxyz)
        length_unit: angstrom     # angstrom | bohr | nm
      targets:
        energy:                   # (or one target of another name, e.g. mtt::U0,
                                  # whose key is then that name by default; as in
                                  # metatrain, its forces and stress default to false
                                  # unless it says quantity: energy)
          key: energy             # info key (or calculator result)
          unit: eV                # eV | meV | Hartree | Ry | kcal/mol | kJ/mol
          forces: auto            # auto: key "forces" if present; {key: K} or
                                  # true: required; false: not used
          stress: auto            # same, key "stress" (eV/Å^3, ASE sign convention)
          virial: false           # {key: K}: virial W = -dE/d strain instead of stress
      extra_data:                 # system_conditioning only. Without it the info keys
        charge: {key: q}          # "charge" (else 0) and "spin_multiplicity" (else
        spin_multiplicity: {key: mult}  # "spin", else 1) are read; mult = 2S+1
      # indices: [0, 5, 9]        # only these structures of the file (or the name of
                                  # a file of indices, one per line)
    validation_set: 0.1           # fraction of training_set, or a dataset like training_set
                                  # (with its own indices), or {indices: [...]}:
                                  # structures of the training file (kept in training
                                  # too, as in metatrain)
    test_set: 0.0                 # the same; evaluated with the best model at the end

``training_set`` may also be a list of datasets (metatrain's form), each with its own
keys and units; a file without some labels (forces, say) contributes NaN labels that
the loss skips. A fraction then takes that share of each file (drawn as ``mtt
train`` draws it with the same seed); a list ``validation_set`` (or ``test_set``)
needs one dataset per training dataset. Every batch comes from one file, as in
metatrain.

metatrain trainer keys that only concern its logging or data loading
(``num_workers``, ``log_mae``, ``log_separate_blocks``, ``distributed_port``) are
accepted and ignored; ``atomic_baseline`` takes metatrain's ``{energy: w}`` and
``{energy: {Z: w, ...}}`` forms (fixed composition weights) or the path of a
checkpoint of metatrain's ``composition`` architecture, ``fixed_scaling_weights``
its ``{energy: c}`` form (a fixed energy scale) or the path of a checkpoint of its
``scaler`` architecture (fitted with that composition checkpoint in its
``additive_models``; reading checkpoints needs metatrain installed); ``max_atoms_per_batch`` (and
``min_atoms_per_batch``) packs batches by atom count as metatrain does;
``per_structure_targets: [energy]`` compares energies (and strain derivatives) per
structure instead of per atom, in the loss, the metrics and the scale. A ``test_set`` is
split off (as ``mtt train`` does) and evaluated with the best model at the end of
training.

Labels: a loss term is trained only if the training set has its labels. With
``forces: auto`` (the default) a dataset without forces trains on energies only;
asking for forces explicitly (``forces: {key: ...}``, ``forces: true`` or a
forces weight in ``loss``) makes missing forces an error that lists the keys found
in the file. Every structure needs the labels its file's terms train on (a frame
without them is an error naming it); a NaN label is skipped, as in metatrain.

Metrics: the progress bar, the log and ``metrics.csv`` report the loss (in training
units) and the RMSE/MAE of energies per atom (eV/atom), forces (eV/Å) and the
strain derivative per atom, ``V sigma / N`` (eV/atom), for the training epoch
(running, augmented) and the validation set. ``petfunc eval`` reports the stress
itself in eV/Å^3.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np


#: the demo run's options (``petfunc train`` without an options file); the training
#: set is the built-in dataset written to the output folder.
DEMO_OPTIONS = {
    "seed": 0,
    "base_precision": 32,
    "device": "cpu",
    "architecture": {
        "name": "pet",
        "model": {
            "cutoff": 4.5,
            "cutoff_width": 0.5,
            "d_pet": 32,
            "d_head": 32,
            "d_node": 64,
            "d_feedforward": 64,
            "num_heads": 4,
            "num_attention_layers": 1,
            "num_gnn_layers": 2,
        },
        "training": {
            "batch_size": 8,
            "num_epochs": 20,
            "learning_rate": 3e-3,
            "warmup_fraction": 0.01,
        },
    },
    "validation_set": 0.1,
}

DEMO_STRUCTURES = 160


def make_default_dataset(path, n_structures: int = DEMO_STRUCTURES, seed: int = 0) -> Path:
    """Write the built-in demo dataset to ``path`` (extxyz) and return the path.

    Random fcc Cu/Al/Ni alloys (50/25/25 %) in cubic cells repeated 1x1x2, 1x1x3,
    1x2x2 and 2x2x2 (8, 12, 16, 32 atoms), lattice constant by Vegard's law, a random
    symmetric strain of 2 % and Gaussian rattling of 0.1 Å; energy, forces and stress
    from ASE's EMT calculator. About 2 s for 160 structures.
    """
    import ase.build
    import ase.io
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    rng = np.random.default_rng(seed)
    lattice = {"Cu": 3.61, "Al": 4.05, "Ni": 3.52}
    repeats = [(1, 1, 2), (1, 2, 2), (2, 2, 2), (1, 1, 3)]
    frames = []
    for i in range(int(n_structures)):
        atoms = ase.build.bulk("Cu", "fcc", a=1.0, cubic=True).repeat(repeats[i % len(repeats)])
        symbols = rng.choice(["Cu", "Al", "Ni"], size=len(atoms), p=[0.5, 0.25, 0.25])
        atoms.set_chemical_symbols(list(symbols))
        a = float(np.mean([lattice[s] for s in symbols]))
        strain = np.eye(3) + rng.normal(0.0, 0.02, (3, 3))
        strain = 0.5 * (strain + strain.T)
        atoms.set_cell(np.asarray(atoms.cell) * a @ strain, scale_atoms=True)
        atoms.positions += rng.normal(0.0, 0.1, atoms.positions.shape)
        atoms.calc = EMT()
        energy = atoms.get_potential_energy()
        forces = atoms.get_forces()
        stress = atoms.get_stress()
        atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=forces, stress=stress)
        frames.append(atoms)
    path = Path(path)
    ase.io.write(str(path), frames, format="extxyz")
    return path


# ---------------------------------------------------------------------------------------
# argument parsing


def _positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (a batch size of -3 read no structure)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="petfunc",
        description="Train and evaluate PET interatomic potentials (pure-functional PyTorch).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    train = sub.add_parser(
        "train",
        help="train a model",
        description="Train a PET model. Without an options file: a demo of about a minute on a "
        "built-in EMT dataset (see `python -m pydoc petfunc.cli` for the options schema).",
    )
    train.add_argument("options", nargs="?", help="options file (metatrain's options.yaml layout)")
    train.add_argument(
        "-o",
        "--output",
        help="output folder (default: outputs/DATE/TIME; with --restart: the checkpoint's folder)",
    )
    train.add_argument("--restart", metavar="CKPT", help="continue from last.ckpt/best.ckpt")
    train.add_argument("--epochs", type=_positive_int, help="architecture.training.num_epochs")
    train.add_argument("--batch-size", type=_positive_int, help="architecture.training.batch_size")
    train.add_argument("--lr", type=float, help="architecture.training.learning_rate")
    train.add_argument("--seed", type=int, help="seed")
    train.add_argument("--dtype", choices=("float32", "float64"), help="base_precision 32 or 64")
    train.add_argument("--device", help="cpu, cuda or cuda:N")
    compiling = train.add_mutually_exclusive_group()
    compiling.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="trace and torch.compile the training and validation steps",
    )
    compiling.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="eager training steps (overrides compile: true of the options file)",
    )
    train.add_argument(
        "--backend", choices=("inductor", "aot_eager", "eager"), help="architecture.training.compile_backend"
    )
    train.add_argument(
        "--remat",
        action="store_true",
        default=None,
        help="recompute the transformer layers in the backward pass (less memory for energy-only losses; not with --compile)",
    )
    determinism = train.add_mutually_exclusive_group()
    determinism.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="fixed-order scatter-adds: the same seed gives the same run (default on CPU only)",
    )
    determinism.add_argument(
        "--nondeterministic",
        dest="deterministic",
        action="store_false",
        help="let scatter-adds sum in any order (runs then differ by round-off)",
    )
    train.add_argument(
        "--no-augmentation",
        dest="augmentation",
        action="store_false",
        default=None,
        help="no random rotations of training structures",
    )
    train.add_argument("--finetune", metavar="MODEL", help="architecture.training.finetune.read_from")
    train.add_argument(
        "--finetune-method",
        choices=("full", "heads", "lora"),
        help="architecture.training.finetune.method (with metatrain's default config)",
    )
    train.add_argument(
        "--structures",
        type=_positive_int,
        default=DEMO_STRUCTURES,
        help=f"size of the built-in demo dataset (default {DEMO_STRUCTURES}; only without an options file)",
    )
    train.add_argument(
        "-s",
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any option, e.g. --set architecture.model.d_pet=64 (VALUE is YAML); repeatable",
    )
    train.add_argument(
        "--no-progress", dest="progress", action="store_false", default=None, help="no progress bar"
    )
    train.add_argument("--threads", type=_positive_int, help="torch CPU threads (default: torch's choice)")

    ev = sub.add_parser(
        "eval",
        help="errors of a model on a dataset",
        description="RMSE and MAE of energies per atom, forces and stress.",
    )
    ev.add_argument(
        "model", help="a petfunc checkpoint (.ckpt), a best_params.pt file, or a metatrain checkpoint"
    )
    ev.add_argument("dataset", help="extxyz file with reference labels")
    ev.add_argument("--batch-size", type=_positive_int, default=16)
    ev.add_argument("--dtype", choices=("float32", "float64"), help="default: the model's")
    ev.add_argument("--device", default="cpu")
    ev.add_argument(
        "--which",
        choices=("best", "last"),
        default="best",
        help="parameters of a training checkpoint (default: best)",
    )
    labels = "(default: as the model was trained, else {})"
    ev.add_argument("--energy-key", help=labels.format("energy"))
    ev.add_argument("--forces-key", help=labels.format("forces"))
    ev.add_argument("--stress-key", help=labels.format("stress"))
    ev.add_argument(
        "--virial-key",
        help="atoms.info key of virial labels W, compared as the stress -W/V " + labels.format("none"),
    )
    ev.add_argument(
        "--charge-key",
        default=None,
        help="atoms.info key of the total charge (conditioned models; default: charge)",
    )
    ev.add_argument(
        "--spin-key",
        default=None,
        help="atoms.info key of the spin multiplicity (conditioned models; "
        "default: spin_multiplicity, else spin)",
    )
    ev.add_argument("--energy-unit", help="unit of the file's energies " + labels.format("eV"))
    ev.add_argument("--length-unit", help="unit of the file's lengths " + labels.format("angstrom"))
    ev.add_argument(
        "--target",
        metavar="NAME",
        help="energy target of a metatrain checkpoint with several (default: 'energy')",
    )
    ev.add_argument("--json", metavar="FILE", help="also write the metrics as JSON")
    ev.add_argument(
        "--output",
        "-o",
        metavar="FILE",
        help="also write the predictions as extxyz (energy, forces, stress of each structure), in the "
        "units the file was read in (--energy-unit, --length-unit)",
    )
    ev.add_argument("--threads", type=_positive_int, help="torch CPU threads (default: torch's choice)")

    ex = sub.add_parser(
        "export",
        help="write a deployment artifact (.pt2)",
        description="Export energy, per-atom energies, forces and strain derivative of a model, "
        "weights included, as a PT2 archive: a torch.export program and (default) its "
        "AOTInductor build. Load it with petfunc.export.load or "
        "PETCalculator.from_exported; see `python -m pydoc petfunc.export`.",
    )
    ex.add_argument(
        "model", help="a petfunc checkpoint (.ckpt), a best_params.pt file, or a metatrain checkpoint"
    )
    ex.add_argument("output", help="the artifact to write (must end in .pt2)")
    ex.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ex.add_argument("--device", default="cpu", help="cpu or cuda: the AOTInductor build runs there only")
    ex.add_argument(
        "--which",
        choices=("best", "last"),
        default="best",
        help="parameters of a training checkpoint (default: best)",
    )
    aoti = ex.add_mutually_exclusive_group()
    aoti.add_argument(
        "--aoti",
        dest="aoti",
        action="store_true",
        default=None,
        help="also the AOTInductor build (the default on the CPU; on a GPU see the README)",
    )
    aoti.add_argument(
        "--no-aoti",
        dest="aoti",
        action="store_false",
        help="only the torch.export program (seconds instead of minutes; no C++ compiler needed; "
        "the default for a GPU)",
    )
    ex.add_argument(
        "--long-range",
        choices=("p3m", "ewald"),
        default=None,
        help="reciprocal-space method of a long-range model: p3m (default; only the "
        "first structure of a call may be periodic) or ewald (batches of crystals)",
    )
    ex.add_argument("--threads", type=_positive_int, help="torch CPU threads (default: torch's choice)")
    return parser


def _yaml_load(stream):
    """``yaml.safe_load`` that reads ``1e-3`` as a number, as metatrain's OmegaConf
    (and YAML 1.2) does; PyYAML's YAML 1.1 rules need a dot (``1.0e-3``) and would
    give the string ``'1e-3'``."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )
    return yaml.load(stream, Loader=Loader)


def _read_options_file(path) -> dict:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"options file not found: {str(path)!r}")
    try:
        with open(path, encoding="utf-8") as handle:
            data = _yaml_load(handle)
    except yaml.YAMLError as error:
        raise ValueError(f"could not parse options file {str(path)!r}: {error}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"options file {str(path)!r} must hold a mapping, got {type(data).__name__}")
    return data


def _overrides(args) -> list[tuple]:
    import yaml

    t = "architecture.training"
    pairs = []
    for name, key, convert in (
        ("epochs", f"{t}.num_epochs", None),
        ("batch_size", f"{t}.batch_size", None),
        ("lr", f"{t}.learning_rate", None),
        ("seed", "seed", None),
        ("dtype", "base_precision", lambda v: 64 if v == "float64" else 32),
        ("device", "device", None),
        ("compile", f"{t}.compile", None),
        ("backend", f"{t}.compile_backend", None),
        ("remat", f"{t}.remat", None),
        ("augmentation", f"{t}.augmentation", None),
        ("deterministic", f"{t}.deterministic", None),
        ("finetune", f"{t}.finetune.read_from", None),
        ("finetune_method", f"{t}.finetune.method", None),
    ):
        value = getattr(args, name)
        if value is not None:
            pairs.append((key, convert(value) if convert else value))
    for item in args.set:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        key, text = item.split("=", 1)
        try:
            value = _yaml_load(text)
        except yaml.YAMLError:
            value = text
        pairs.append((key.strip(), value))
    return pairs


def _train(args) -> int:
    from petfunc.io.checkpoint import read_checkpoint
    from petfunc.trainer.options import set_option
    from petfunc.trainer.training import TrainingError

    restart = args.restart
    if restart is not None:
        ckpt = read_checkpoint(restart)
        stored = json.loads(ckpt["options"])
    if args.options:
        options = _read_options_file(args.options)
        demo = False
    elif restart is not None:
        options = stored
        demo = False
    else:
        options = copy.deepcopy(DEMO_OPTIONS)
        demo = True
        if args.finetune:
            # the architecture is the fine-tuned model's: the demo's would be compared
            # with it (and refused) although the user never asked for it
            options["architecture"]["model"] = {}
    if restart is not None and args.options and "training_set" not in options:
        options["training_set"] = stored["training_set"]
        options.setdefault("validation_set", stored["validation_set"])
        if "test_set" in stored:
            options.setdefault("test_set", stored["test_set"])
    for key, value in _overrides(args):
        set_option(options, key, value)
    if demo and options.get("training_set") is not None:
        demo = False  # --set training_set=...: the demo's defaults on the user's data
    if not demo and args.structures != DEMO_STRUCTURES:
        print(
            f"petfunc: warning: --structures {args.structures} is not used: it sizes the built-in demo "
            "dataset, and this run reads its own",
            file=sys.stderr,
        )

    # >>> petfunc.distributed: under torchrun (WORLD_SIZE > 1) every process joins the
    # process group and trains on its shard of each batch; rank 0 alone writes files
    # and logs (the output folder is rank 0's choice).
    from petfunc.distributed import process as pdist

    dist_kwargs, rank = {}, 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = str(options.get("device") or "cpu")
        info = pdist.init_from_env(device="cuda" if device.startswith("cuda") else "cpu")
        rank = info.rank
        if device.startswith("cuda"):
            options["device"] = str(info.device)  # cuda:LOCAL_RANK
        dist_kwargs = dict(
            rank=info.rank, world_size=info.world_size, reduce_metrics=pdist.all_reduce_metrics
        )
        if rank != 0:
            dist_kwargs.update(log=lambda message: None, progress=False)
    # <<< petfunc.distributed

    if args.output:
        output = Path(args.output)
    elif restart is not None:
        output = Path(restart).resolve().parent
    else:
        now = datetime.datetime.now()
        output = Path("outputs") / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S")
    output = Path(pdist.broadcast_object(str(output)))  # petfunc.distributed: rank 0's folder
    if output.exists() and not output.is_dir():
        raise ValueError(f"the output folder {str(output)!r} is a file")
    before = _FolderSnapshot(output, demo) if rank == 0 else None
    if rank == 0:  # rank 0 alone writes; another rank's mkdir raced its snapshot of the folder
        output.mkdir(parents=True, exist_ok=True)
    try:
        return _train_into(args, options, output, demo, restart, rank, dist_kwargs)
    except TrainingError:
        raise  # training ran: its folder is the record of the run
    except BaseException:
        if before is not None and before.undo_if_untouched():
            args.wrote_nothing = True
            if not output.exists():
                print(
                    f"petfunc: removed the output folder {output} (the run wrote no checkpoint to it)",
                    file=sys.stderr,
                )
        raise


class _FolderSnapshot:
    """What the output folder held before ``petfunc train`` began, so that a run that
    stops before its first checkpoint (bad data or options, Ctrl-C while the files
    are read or in the first epoch) leaves no trace: the ``options.yaml`` it wrote
    (and the demo's ``dataset.xyz``) is removed, one it replaced (a restart into
    its own folder) is restored, and the folders it made are removed.

    When anything else in the folder was written or changed (a checkpoint,
    ``metrics.csv``), everything is kept; so is the folder of a run that a NaN loss
    stopped (:class:`petfunc.trainer.TrainingError`): its ``options.yaml`` records
    the run that diverged.
    """

    def __init__(self, output: Path, demo: bool):
        self.output = output
        # the files the command itself writes before training starts
        self.own = ("options.yaml", "dataset.xyz") if demo else ("options.yaml",)
        self.made = [p for p in (output, *output.parents) if not p.exists()]  # deepest first
        self.entries = self._entries()
        self.previous = {}
        for name in self.own:
            if (output / name).is_file():
                self.previous[name] = (output / name).read_bytes()

    def _entries(self):
        if not self.output.is_dir():
            return {}
        return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in self.output.iterdir()}

    def undo_if_untouched(self) -> bool:
        """Undo the command's own writes unless something else changed in the folder;
        returns whether it did."""
        now = self._entries()
        others = {name: state for name, state in now.items() if name not in self.own}
        if others != {name: state for name, state in self.entries.items() if name not in self.own}:
            return False  # training wrote something: keep the folder as it is
        for name in self.own:
            path = self.output / name
            try:
                if name in self.previous:
                    if path.read_bytes() != self.previous[name]:
                        path.write_bytes(self.previous[name])
                elif path.is_file():
                    path.unlink()
            except OSError:
                pass
        for folder in self.made:
            try:
                folder.rmdir()
            except OSError:
                break  # not empty (or not ours to remove)
        return True


def _train_into(args, options, output, demo, restart, rank, dist_kwargs) -> int:
    """The part of :func:`_train` that writes into the output folder."""
    import yaml

    from petfunc.distributed import process as pdist
    from petfunc.trainer.options import resolve_options
    from petfunc.trainer.training import fit

    if demo:
        # check the options before spending time on the dataset
        probe = copy.deepcopy(options)
        probe["training_set"] = "dataset.xyz"
        resolve_options(probe)
        path = output / "dataset.xyz"
        if rank == 0:  # petfunc.distributed: rank 0 writes, the others wait
            print(
                f"demo run: writing the built-in EMT dataset ({args.structures} Cu/Al/Ni structures) to {path}"
            )
            make_default_dataset(path, args.structures, seed=options.get("seed", 0) or 0)
        pdist.barrier()
        options["training_set"] = str(path.resolve())

    from petfunc.trainer.training import _absolute_paths

    resolved = _absolute_paths(resolve_options(options))
    if rank == 0:  # petfunc.distributed
        with open(output / "options.yaml", "w", encoding="utf-8") as handle:
            yaml.safe_dump(resolved, handle, sort_keys=False)
        print(f"output folder: {output}")
    kwargs = dict(restart=restart, progress=args.progress)
    kwargs.update(dist_kwargs)  # petfunc.distributed
    try:
        fit(resolved, output, **kwargs)
    except BaseException as error:
        # petfunc.distributed (no-op in one process): an error every rank raises at
        # the same point leaves together, as a finished run does (one rank tearing the
        # group down first made gloo abort another at exit); others leave at once
        pdist.shutdown(wait_for_all=isinstance(error, pdist.RunMismatchError))
        raise
    pdist.shutdown()  # petfunc.distributed: all ranks leave together
    return 0


_LABEL_DEFAULTS = {
    "energy_key": "energy",
    "forces_key": "forces",
    "stress_key": "stress",
    "virial_key": None,
    "energy_unit": "eV",
    "length_unit": "angstrom",
}


def _label_options(args) -> None:
    """Fill the label keys and units ``petfunc eval`` was not given: from the first
    training file of a petfunc checkpoint's options (a model trained on ``U0`` in
    kcal/mol is evaluated on ``U0`` in kcal/mol), the units of a metatrain model's
    training data, else the defaults."""
    from petfunc.trainer.training import training_label_options

    missing = [name for name in _LABEL_DEFAULTS if getattr(args, name) is None]
    trained = training_label_options(args.model, args.target) if missing else {}
    taken = []
    for name in missing:
        value = trained.get(name, _LABEL_DEFAULTS[name])
        setattr(args, name, value)
        if value != _LABEL_DEFAULTS[name]:
            taken.append(f"{name.replace('_', ' ')} {value!r}")
    if taken:
        # say which keys go with the units taken: a metatrain model stores its units but
        # not its keys, and a file whose default keys hold labels in other units would
        # otherwise give wrong errors without a word
        keys = [
            f"{name.split('_')[0]} {getattr(args, name)!r}"
            for name in ("energy_key", "forces_key", "stress_key", "virial_key")
            if getattr(args, name)
        ]
        print(
            "labels read as the model was trained: "
            + ", ".join(taken)
            + "; keys "
            + ", ".join(keys)
            + " (--energy-unit, --length-unit and the --*-key options override)"
        )


def _eval(args) -> int:
    import torch

    from petfunc.trainer.training import evaluate

    dtype = {"float32": torch.float32, "float64": torch.float64, None: None}[args.dtype]
    # keys given on the command line must be in the file; defaults may be absent
    named = [
        getattr(args, name)
        for name in ("energy_key", "forces_key", "stress_key", "virial_key")
        if getattr(args, name) is not None
    ]
    if args.stress_key is not None and args.virial_key is not None:
        # two labels of one quantity (metatrain's options refuse them too); the
        # stress was used and the virial ignored without a word
        raise ValueError("give --stress-key or --virial-key, not both: they label the same quantity")
    _label_options(args)
    metrics, _ = evaluate(
        args.model,
        args.dataset,
        batch_size=args.batch_size,
        dtype=dtype,
        device=args.device,
        which=args.which,
        energy_key=args.energy_key,
        forces_key=args.forces_key,
        stress_key=args.stress_key,
        virial_key=args.virial_key,
        energy_unit=args.energy_unit,
        length_unit=args.length_unit,
        charge_key=args.charge_key,
        spin_multiplicity_key=args.spin_key,
        output=args.output,
        target=args.target,
        required_keys=named,
    )
    print(f"{args.dataset}: {metrics['n_structures']} structures, {metrics['n_atoms']} atoms")
    rows = (
        ("energy_per_atom", "energy/atom", "eV/atom"),
        ("forces", "forces", "eV/Å"),
        ("stress", "stress", "eV/Å^3"),
    )
    if any(f"{key}_rmse" in metrics for key, _, _ in rows):
        print(f"{'':16s}{'RMSE':>12s}{'MAE':>12s}  unit      labels")
    else:
        print("no labels in the file: predictions only")
    for key, name, unit in rows:
        if f"{key}_rmse" in metrics:
            print(
                f"{name:16s}{metrics[f'{key}_rmse']:12.5g}{metrics[f'{key}_mae']:12.5g}  "
                f"{unit:8s}  {metrics[f'{key}_count']}"
            )
        if metrics.get(f"{key}_nan_predictions"):
            print(f"warning: {metrics[f'{key}_nan_predictions']} {name} predictions are NaN", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(metrics, indent=2))
    if args.output:
        print(f"predictions written to {args.output}")
    return 0


def _export(args) -> int:
    import time

    import torch

    from petfunc.export.package import default_aoti, export
    from petfunc.io.load import load_model

    if not args.output.endswith(".pt2"):
        raise ValueError(f"the output file name must end in .pt2, got {args.output!r}")
    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    config, params = load_model(args.model, which=args.which)
    aoti = default_aoti(args.device, config, args.long_range) if args.aoti is None else args.aoti
    what = (
        "torch.export program and AOTInductor build (this takes minutes)" if aoti else "torch.export program"
    )
    lr = f", long range by {args.long_range or 'p3m'}" if config.long_range.enable else ""
    print(f"exporting {args.model} ({args.dtype}, {args.device}{lr}): {what}")
    from petfunc.io.metatrain import is_llpr_checkpoint

    if is_llpr_checkpoint(args.model):
        print(
            f"petfunc: note: {args.model} is an LLPR checkpoint: the export holds its PET (energy, forces, "
            "stress), not the uncertainty; PETCalculator.from_metatrain(path) gives both",
            file=sys.stderr,
        )
    start = time.perf_counter()
    if args.long_range and not config.long_range.enable:
        raise ValueError(f"--long-range {args.long_range}: {args.model} has no long-range features")
    path = export(
        config, params, args.output, dtype=dtype, device=args.device, aoti=aoti, long_range=args.long_range
    )
    size = path.stat().st_size / 2**20
    print(f"wrote {path} ({size:.1f} MiB) in {time.perf_counter() - start:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``petfunc`` command; returns the exit status.

    Errors in options or data print ``petfunc: error: ...`` and return 2; a diverged
    training (NaN/inf loss) returns 1.
    """
    from petfunc.allocator import keep_freed_memory
    from petfunc.trainer.training import TrainingError

    parser = _parser()
    args = parser.parse_args(argv)
    # a step frees and reallocates the same memory every call: keep it mapped
    keep_freed_memory()
    if args.threads is not None:
        import torch

        if args.threads < 1:
            parser.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    previous = None
    if args.command == "train" and threading.current_thread() is threading.main_thread():
        # SIGTERM (a scheduler, torchrun stopping the other processes when one fails)
        # ends the run as Ctrl-C does: an output folder the run has not written to yet
        # is put back as it was (torchrun's SIGTERM left another run's options.yaml)
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "export":
            return _export(args)
        return _eval(args)
    except TrainingError as error:
        print(f"petfunc: training stopped: {error}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, NotImplementedError, TypeError) as error:
        print(f"petfunc: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as error:
        wrote = args.command == "train" and not getattr(args, "wrote_nothing", False)
        terminated = isinstance(error, _Terminated)
        print(
            f"petfunc: {'terminated' if terminated else 'interrupted'}"
            + (" (the checkpoints written so far are intact)" if wrote else ""),
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM if terminated else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so that its clean-up runs."""


def _terminate(signum, frame):
    raise _Terminated()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
