"""Quantized formats and their scale arithmetic."""
