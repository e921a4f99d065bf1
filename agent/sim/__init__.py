"""The simulated node: what the agent talks to on a GPU node, emulated in rooms that mirror what they stand in for.

* ``agent.sim.nvml``: the GPU driver beneath pynvml. ``install`` hands pynvml a library object that answers the
  same C symbols ``libnvidia-ml.so.1`` exports, writing into the same ctypes structs and returning the same
  ``nvmlReturn_t`` codes, so nothing above pynvml knows it is simulated. Its ``control`` socket lets tests and the
  demo act on a running agent's driver.
* ``agent.sim.kubelet``: the kubelet's device manager (Registration, ListAndWatch, Allocate) and PodResources API.
* ``agent.sim.mps``: the ``nvidia-cuda-mps-control`` executable.
* ``agent.sim.apiserver``: the Kubernetes API server, for the objects the DRA driver reads and writes
  (ResourceSlices, ResourceClaims, DeviceClasses, Nodes), spoken to by the real Kubernetes client over HTTP and
  validating every write against the real OpenAPI schemas.
* ``agent.sim.scheduler``: the kube-scheduler's DRA allocation (CEL selectors, counts, constraints).
* ``agent/sim/presets``: node descriptions (YAML) that ``agent.sim.nvml.spec`` loads by name, for the demo and tests.
"""
