"""`python -m qdqgraph ...`: the `qdqgraph` command, where the console script is not on PATH."""
from .cli import entry

entry()
