"""Data: labelled structures, batches of them, and what is fitted on them.

- :mod:`petfunc.data.samples`: :class:`Sample` (one structure, its graph and labels),
  :class:`Batch` (padded, collated samples in training units), :func:`make_batch`;
  :mod:`petfunc.data.dataset`: :class:`Dataset`, :func:`read_dataset`.
- :mod:`petfunc.data.baselines`: the composition weights and the energy scale fitted
  on the training set, and ZBL's share of the labels.
- :mod:`petfunc.data.read`: reading labelled extxyz files with ASE.
- :mod:`petfunc.data.splits`: training/validation/test splits as ``mtt train`` draws them.
- :mod:`petfunc.data.batching`: the order and grouping of batches in an epoch.
"""

from petfunc.data.baselines import composition_counts as composition_counts
from petfunc.data.baselines import fit_composition as fit_composition
from petfunc.data.baselines import fit_scale as fit_scale
from petfunc.data.batching import batch_plan as batch_plan
from petfunc.data.batching import derived_seed as derived_seed
from petfunc.data.batching import pack_by_atoms as pack_by_atoms
from petfunc.data.dataset import Dataset as Dataset
from petfunc.data.dataset import read_dataset as read_dataset
from petfunc.data.read import Labels as Labels
from petfunc.data.read import available_keys as available_keys
from petfunc.data.read import check_info_keys as check_info_keys
from petfunc.data.read import has_key as has_key
from petfunc.data.read import read_frames as read_frames
from petfunc.data.read import read_labelled as read_labelled
from petfunc.data.read import require_complete_labels as require_complete_labels
from petfunc.data.read import to_samples as to_samples
from petfunc.data.samples import Batch as Batch
from petfunc.data.samples import Sample as Sample
from petfunc.data.samples import make_batch as make_batch
from petfunc.data.samples import padding_sample as padding_sample
from petfunc.data.samples import random_rotations as random_rotations
from petfunc.data.samples import sample_from_atoms as sample_from_atoms
from petfunc.data.samples import zbl_baseline as zbl_baseline
from petfunc.data.splits import restart_split as restart_split
from petfunc.data.splits import split_datasets as split_datasets
from petfunc.data.splits import split_indices as split_indices
