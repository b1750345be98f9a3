"""petfunc.cli."""

from petfunc.cli.main import (
    DEMO_OPTIONS,
    DEMO_STRUCTURES,
    main,
    make_default_dataset,
)
