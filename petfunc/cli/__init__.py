"""petfunc.cli."""

from petfunc.cli.commands import (
    DEMO_OPTIONS,
    DEMO_STRUCTURES,
    main,
    make_default_dataset,
)
