"""The pure core: immutable values and deterministic functions, no I/O.

Everything here is computed from its arguments only, so it is unit-testable and the same inputs
always give the same device IDs in the same order.
"""
