"""Running things: onnxruntime sessions, Ray, comparison, the stage profile, progress bars."""
