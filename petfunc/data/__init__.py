"""petfunc.data."""

from petfunc.data.samples import (
    Batch,
    Dataset,
    Sample,
    composition_counts,
    fit_composition,
    fit_scale,
    kept_graph_too_small,
    make_batch,
    needs_padding,
    padding_sample,
    random_rotations,
    read_dataset,
    sample_from_atoms,
    zbl_baseline,
)
