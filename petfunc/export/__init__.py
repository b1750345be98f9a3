"""petfunc.export."""

from petfunc.export.package import (
    FORMAT,
    INPUTS,
    LONG_RANGE_INPUTS,
    METADATA,
    N_GRAPH_FIELDS,
    OUTPUTS,
    READABLE_VERSIONS,
    VERSION,
    ExportedPET,
    default_aoti,
    export,
    input_names,
    load,
    long_range_inputs,
    trace,
)
