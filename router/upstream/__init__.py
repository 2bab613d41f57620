"""Calls to workers: one choice's generate call, what the worker's answers mean, and migration on loss."""
