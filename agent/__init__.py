"""Tessera: a node-level GPU sharing agent for Kubernetes."""

__version__ = "0.1.0"
