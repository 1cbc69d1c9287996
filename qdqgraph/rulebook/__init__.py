"""The one rule engine of qdqgraph: rule files read and checked, conditions evaluated.

Placement (`qdqgraph.placement`) and the TensorRT simulator (`qdqgraph.trtsim`) keep their rules as
TOML data in `rules/`; both read them, check them and match them with the code here, and each
registers its own conditions.
"""
