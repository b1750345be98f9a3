"""The ``petfunc train`` application: :func:`fit` trains PET from metatrain-style options."""

from petfunc.io.checkpoint import read_checkpoint as load_checkpoint
from petfunc.io.checkpoint import state_from_plain as state_from_plain
from petfunc.io.checkpoint import state_to_plain as state_to_plain
from petfunc.io.load import load_model as load_model
from petfunc.trainer.training import TERMS as TERMS
from petfunc.trainer.training import FitResult as FitResult
from petfunc.trainer.training import TrainingError as TrainingError
from petfunc.trainer.training import check_model_section as check_model_section
from petfunc.trainer.training import error_metrics as error_metrics
from petfunc.trainer.training import evaluate as evaluate
from petfunc.trainer.training import fit as fit
from petfunc.trainer.training import iterate_batches as iterate_batches
from petfunc.trainer.training import parity_plot as parity_plot
from petfunc.trainer.training import predict as predict
from petfunc.trainer.training import selected_metric as selected_metric
from petfunc.trainer.training import training_label_options as training_label_options
from petfunc.trainer.training import write_predictions as write_predictions
