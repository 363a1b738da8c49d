"""The package's version, in a module of its own: the transport's handshake and the model card read it, and
importing it from the package `__init__` (which lazily imports the Python API) would point an arrow upward."""

__version__ = "0.1.0"  # keep equal to pyproject.toml's `version`
