"""petfunc's version (also the package metadata's, see pyproject.toml)."""

__version__ = "0.1.0"
