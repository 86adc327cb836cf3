"""mixprec's version (one home: the package, the command line and saved files read it)."""

__version__ = "0.1.0"
