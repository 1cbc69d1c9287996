"""`python -m qdqgraph.cli ...`: the `qdqgraph` command."""
import sys

from . import main

sys.exit(main())
