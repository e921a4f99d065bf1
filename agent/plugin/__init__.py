"""The kubelet Device Plugin API: one gRPC server per resource, registration, restart detection."""
