"""The options of ``petfunc train`` (metatrain's ``options.yaml`` layout): defaults,
checks, and the expansion of shorthands (``docs/options.md`` lists every key).

- :mod:`petfunc.trainer.options.schema`: :func:`resolve_options`, the defaults.
- :mod:`petfunc.trainer.options.datasets`: the dataset sections.
- :mod:`petfunc.trainer.options.loss`: the loss section.
- :mod:`petfunc.trainer.options.baselines`: fixed composition weights and scale.
- :mod:`petfunc.trainer.options.finetune`: the fine-tuning section.
- :mod:`petfunc.trainer.options.checks`: key, number and module-name checks.
"""

from petfunc.trainer.options.baselines import atomic_baseline as atomic_baseline
from petfunc.trainer.options.baselines import fixed_composition as fixed_composition
from petfunc.trainer.options.baselines import fixed_scaling_weights as fixed_scaling_weights
from petfunc.trainer.options.checks import check_keys as check_keys
from petfunc.trainer.options.datasets import dataset_sections as dataset_sections
from petfunc.trainer.options.datasets import held_out as held_out
from petfunc.trainer.options.datasets import indices_only as indices_only
from petfunc.trainer.options.datasets import load_indices as load_indices
from petfunc.trainer.options.datasets import resolve_dataset as resolve_dataset
from petfunc.trainer.options.datasets import resolve_datasets as resolve_datasets
from petfunc.trainer.options.finetune import trained_parameters as trained_parameters
from petfunc.trainer.options.loss import parse_loss as parse_loss
from petfunc.trainer.options.schema import IGNORED_METATRAIN_KEYS as IGNORED_METATRAIN_KEYS
from petfunc.trainer.options.schema import (
    IGNORED_METATRAIN_TOP_LEVEL_KEYS as IGNORED_METATRAIN_TOP_LEVEL_KEYS,
)
from petfunc.trainer.options.schema import TOP_LEVEL_DEFAULTS as TOP_LEVEL_DEFAULTS
from petfunc.trainer.options.schema import TRAINING_DEFAULTS as TRAINING_DEFAULTS
from petfunc.trainer.options.schema import absolute_paths as absolute_paths
from petfunc.trainer.options.schema import resolve_options as resolve_options
from petfunc.trainer.options.schema import set_option as set_option
