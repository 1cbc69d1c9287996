"""`python -m qdqgraph.cli ...`: the `qdqgraph` command."""
from . import entry

entry()
