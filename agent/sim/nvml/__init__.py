"""Stands in for the NVIDIA driver and ``libnvidia-ml.so.1`` beneath pynvml.

``driver`` holds the node's state and the hardware's rules (GPUs, MIG instances, processes, events, faults) over
the hardware table in ``hardware`` (``data/models.yaml`` plus the agent's MIG profiles); ``libnvml`` answers the C
symbols pynvml calls from that driver, with the ``nvmlReturn_t`` values of ``codes``; ``install`` puts it where pynvml
would load the real library; ``spec`` builds a node from YAML or a preset (``agent/sim/presets``); ``control`` is the
unix socket through which tests and the demo reach a running agent's simulated driver (inject an XID, lose a GPU).
"""
