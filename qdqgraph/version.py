"""The version of qdqgraph, in one place that every module may import (the package root imports the
whole API, so a module deep inside it cannot import the root without a cycle)."""
__version__ = "0.1.0"
