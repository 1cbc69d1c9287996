"""What qdqgraph's tests and benchmarks build on, kept apart from the tool itself.

    models.py   Q/DQ graphs rebuilt in code (no torch) for the NVIDIA engine reports in
                tests/data/oracles, and small reference networks
    oracles.py  each oracle's engine-layer JSON paired with the builder of its graph
    render.py   a graph as text, one node a line, for golden-text tests

Nothing under qdqgraph/ outside this package imports it.
"""
