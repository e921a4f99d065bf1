"""Telemetry: Prometheus metrics attributed to pods, health endpoints, node labels for the scheduler."""
