"""Samples for calibration and comparison: arrays from .npz/.npy files and folders, images."""
