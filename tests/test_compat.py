"""Code written for petfunc's earlier flat layout keeps working
(petfunc/_compat.py): every name the package exported, every path the
documentation named, and every public module path, the moved ones with a
``DeprecationWarning`` that names the new path."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import petfunc


ROOT = Path(__file__).resolve().parents[1]

#: the public names of ``petfunc`` in the flat layout
EXPORTED = (
    "Batch",
    "Dataset",
    "LongRangeConfig",
    "LossTerm",
    "LossWeights",
    "Neighbors",
    "PET",
    "PETConfig",
    "Sample",
    "Structure",
    "TrainState",
    "adaptive",
    "allocator",
    "apply_gradients",
    "ase",
    "ase_batch",
    "batching",
    "bmm",
    "cell_volume",
    "collate",
    "compile",
    "config",
    "cutoff",
    "data",
    "datafiles",
    "derivatives",
    "determinism",
    "deterministic_algorithms",
    "distributed",
    "dynamics",
    "energy_and_forces",
    "energy_forces_strain_derivative",
    "energy_forces_stress",
    "energy_terms_forces_strain_derivative",
    "ensemble",
    "export",
    "fit",
    "forces",
    "from_atoms",
    "from_metatrain",
    "fused_attention",
    "hessian",
    "hessian_loss",
    "hvp",
    "init",
    "init_state",
    "io",
    "llpr",
    "load_model",
    "load_params",
    "long_range",
    "lookup",
    "lora",
    "loss",
    "make_batch",
    "make_grad_step",
    "make_loss",
    "make_optimizer",
    "make_train_step",
    "model",
    "neighbors",
    "nn",
    "options",
    "pack_state",
    "permute",
    "prepare",
    "prepare_atoms",
    "read_dataset",
    "relax",
    "remat",
    "save_params",
    "structures",
    "train",
    "trainer",
    "transformer",
    "tree",
    "warmup_cosine",
)

#: the dotted paths its README, docs and examples named
DOCUMENTED = (
    "petfunc.Dataset",
    "petfunc.LossWeights",
    "petfunc.LossWeights.make",
    "petfunc.PET",
    "petfunc.PETConfig",
    "petfunc.allocator",
    "petfunc.allocator.keep_freed_memory",
    "petfunc.ase",
    "petfunc.ase.PETCalculator",
    "petfunc.bmm",
    "petfunc.cli",
    "petfunc.compile",
    "petfunc.data.sample_from_atoms",
    "petfunc.deterministic_algorithms",
    "petfunc.distributed",
    "petfunc.distributed.DistributedError",
    "petfunc.distributed.shutdown",
    "petfunc.dynamics.Langevin",
    "petfunc.dynamics.run",
    "petfunc.energy_and_forces",
    "petfunc.energy_forces_stress",
    "petfunc.ensemble",
    "petfunc.export",
    "petfunc.export.load",
    "petfunc.forces",
    "petfunc.from_atoms",
    "petfunc.from_metatrain",
    "petfunc.hessian",
    "petfunc.hessian_loss",
    "petfunc.hvp",
    "petfunc.init",
    "petfunc.init_state",
    "petfunc.llpr",
    "petfunc.llpr.energy_and_uncertainty",
    "petfunc.llpr.ensemble",
    "petfunc.llpr.from_metatrain",
    "petfunc.long_range",
    "petfunc.lookup.lookup_rows",
    "petfunc.lora",
    "petfunc.lora.TRAIN",
    "petfunc.lora.attach",
    "petfunc.make_loss",
    "petfunc.make_optimizer",
    "petfunc.make_train_step",
    "petfunc.model.last_layer_features",
    "petfunc.nn.layer_norm",
    "petfunc.pack_state",
    "petfunc.permute.permute_rows",
    "petfunc.relax.fire",
    "petfunc.remat",
    "petfunc.remat.saved_tensor_bytes",
    "petfunc.train.HEADS",
    "petfunc.tree.flatten",
    "petfunc.warmup_cosine",
)

#: modules of the flat layout now elsewhere, imported with a DeprecationWarning
MOVED = {
    "adaptive": "petfunc.model.adaptive",
    "ase_batch": "petfunc.ase.batch",
    "batching": "petfunc.data.batching",
    "bmm": "petfunc.ops.bmm",
    "cutoff": "petfunc.model.cutoff",
    "datafiles": "petfunc.data.read",
    "fused_attention": "petfunc.ops.fused_attention",
    "long_range": "petfunc.model.long_range",
    "lookup": "petfunc.ops.lookup",
    "loss": "petfunc.train.loss",
    "neighbors": "petfunc.graph.neighbors",
    "nn": "petfunc.model.nn",
    "options": "petfunc.trainer.options",
    "permute": "petfunc.ops.permute",
    "transformer": "petfunc.model.transformer",
    "zbl": "petfunc.model.zbl",
}
#: and the one imported without a warning (it is also a documented attribute)
ALIASES = {"hessian_loss": "petfunc.train.hessian_loss"}


#: its public modules
MODULES = (
    "adaptive",
    "allocator",
    "ase",
    "ase_batch",
    "batching",
    "bmm",
    "cli",
    "compile",
    "config",
    "cutoff",
    "data",
    "datafiles",
    "derivatives",
    "determinism",
    "distributed",
    "dynamics",
    "ensemble",
    "export",
    "fused_attention",
    "hessian",
    "hessian_loss",
    "io",
    "llpr",
    "long_range",
    "lookup",
    "lora",
    "loss",
    "model",
    "neighbors",
    "nn",
    "options",
    "permute",
    "relax",
    "remat",
    "structures",
    "train",
    "trainer",
    "transformer",
    "tree",
    "zbl",
)


def resolve(path: str):
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = __import__(".".join(parts[:i]), fromlist=["_"])
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("name", EXPORTED)
def test_every_exported_name_is_still_there(name):
    assert getattr(petfunc, name) is not None


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("path", DOCUMENTED)
def test_every_documented_path_resolves(path):
    assert resolve(path) is not None


def test_old_module_paths_import_and_the_moved_ones_warn():
    """In a fresh interpreter (an import is made once per process): ``import
    petfunc.<old>`` gives the module at its new path, warning where it moved."""
    script = """
import importlib, json, sys, warnings
import petfunc
report = {}
for name in sys.argv[1:]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module("petfunc." + name)
    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
    report[name] = [module.__name__, messages]
print(json.dumps(report))
"""
    out = subprocess.run(
        [sys.executable, "-c", script, *MODULES], capture_output=True, text=True, cwd=ROOT, check=True
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for name in MODULES:
        old = f"petfunc.{name}"
        module, messages = report[name]
        if name in MOVED:
            assert module == MOVED[name]
            assert messages == [f"{old} is now {module}; the old path goes in a later release"], name
        else:
            assert module == ALIASES.get(name, old) and messages == [], (name, module, messages)


def test_moved_modules_are_the_new_modules():
    with pytest.warns(DeprecationWarning, match="petfunc.neighbors is now petfunc.graph.neighbors"):
        old = petfunc.neighbors
    assert old is petfunc.graph.neighbors
    with pytest.raises(AttributeError, match="no attribute 'no_such_module'"):
        petfunc.no_such_module  # noqa: B018 - the attribute access is the test
