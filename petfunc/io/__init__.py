"""petfunc.io."""

from petfunc.io.params import (
    EXTRA_KEYS,
    FORMAT,
    FORMAT_VERSION,
    LONG_RANGE_WEIGHTS,
    TRUST_ENV,
    UnreadableCheckpointError,
    atomic_save,
    cast_params,
    check_params,
    from_metatrain,
    is_llpr_checkpoint,
    is_petfunc_export,
    load_params,
    metatrain_units,
    network_dtype,
    params_from_payload,
    read_metatrain_baseline,
    save_params,
    to_metatrain_state_dict,
)
