"""petfunc.train."""

from petfunc.train.step import (
    FROZEN,
    HEADS,
    AdamState,
    TrainState,
    adam,
    apply_gradients,
    apply_updates,
    clip_by_global_norm,
    grad_step_of,
    init_state,
    make_grad_step,
    make_optimizer,
    make_train_step,
    pack_params,
    pack_state,
    train_step_of,
    trainable,
    value_and_grad,
    warmup_cosine,
    with_trained,
)
