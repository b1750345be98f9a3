"""petfunc.trainer."""

from petfunc.trainer.fit import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    TERMS,
    FitResult,
    TrainingError,
    check_model_section,
    error_metrics,
    evaluate,
    fit,
    iterate_batches,
    load_checkpoint,
    load_model,
    parity_plot,
    predict,
    selected_metric,
    state_from_plain,
    state_to_plain,
    training_label_options,
    write_predictions,
)
