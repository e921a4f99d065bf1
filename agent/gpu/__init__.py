"""The only code that imports pynvml: discovery now; health events, telemetry reads and MIG writes later."""
