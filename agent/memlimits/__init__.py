"""GPU memory the driver enforces per container (path (b)): find each container holding sized devices, set its
limits through NVML, read them back, repair them. See ``agent.core.memlimits`` for what is wanted and why."""
