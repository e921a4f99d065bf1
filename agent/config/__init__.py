"""The sharing config (a ConfigMap written for NVIDIA's device plugin, plus Tessera's extensions)."""
