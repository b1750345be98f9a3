"""The ``petfunc train`` application: :func:`fit` trains PET from metatrain-style options.

- :mod:`petfunc.trainer.run`: :func:`fit` and :class:`FitResult`.
- :mod:`petfunc.trainer.setup`: the phases that prepare a run (options, data, model,
  steps, output folder), each returning a value.
- :mod:`petfunc.trainer.loop`: the epochs.
- :mod:`petfunc.trainer.steps`, :mod:`~petfunc.trainer.batches`,
  :mod:`~petfunc.trainer.processes`: the step functions, the batches, and how a run
  is shared by processes.
- :mod:`petfunc.trainer.datasets`, :mod:`~petfunc.trainer.labels`,
  :mod:`~petfunc.trainer.models`, :mod:`~petfunc.trainer.baselines`: the data, the
  starting model, the composition weights and energy scale.
- :mod:`petfunc.trainer.checkpoints`, :mod:`~petfunc.trainer.restart`: the output
  folder, and what a restart checks and restores.
- :mod:`petfunc.trainer.metrics`, :mod:`~petfunc.trainer.evaluation`: the numbers a
  run reports; predictions and their errors (``petfunc eval``).
- :mod:`petfunc.trainer.runlog`, :mod:`~petfunc.trainer.memory`: the run's log (the
  ``petfunc`` loggers, ``train.log``); out of memory named as such.
- :mod:`petfunc.trainer.options`: the options (``docs/options.md``).
"""

from petfunc.io import load_model as load_model
from petfunc.io import read_checkpoint as load_checkpoint  # noqa: F401 - its name in the trainer
from petfunc.io.checkpoint import state_from_plain as state_from_plain
from petfunc.io.checkpoint import state_to_plain as state_to_plain
from petfunc.trainer.batches import iterate_batches as iterate_batches
from petfunc.trainer.evaluation import error_metrics as error_metrics
from petfunc.trainer.evaluation import evaluate as evaluate
from petfunc.trainer.evaluation import parity_plot as parity_plot
from petfunc.trainer.evaluation import predict as predict
from petfunc.trainer.evaluation import training_label_options as training_label_options
from petfunc.trainer.evaluation import write_predictions as write_predictions
from petfunc.trainer.memory import OutOfMemory as OutOfMemory
from petfunc.trainer.metrics import TERMS as TERMS
from petfunc.trainer.metrics import TrainingError as TrainingError
from petfunc.trainer.metrics import selected_metric as selected_metric
from petfunc.trainer.models import check_model_section as check_model_section
from petfunc.trainer.run import FitResult as FitResult
from petfunc.trainer.run import fit as fit
