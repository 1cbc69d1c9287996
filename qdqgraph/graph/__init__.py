"""The model as a graph: reading and writing ONNX, read-only views, regions and blocks found by structure."""
