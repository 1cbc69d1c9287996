"""Recipes: steps that measure on calibration data and decide (the attention check, sensitivity)."""
