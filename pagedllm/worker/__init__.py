"""Runs the model for a scheduled step on one device."""
