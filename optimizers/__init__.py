"""Optimizer algorithms and their registry. Pure: never imports ``optzoo`` or ``routing``."""

from .registry import OptimizerSpec, get_spec, register, registered_names

__all__ = ["OptimizerSpec", "get_spec", "register", "registered_names"]
