"""Node specs and configs shared by the reliability scenarios."""

from __future__ import annotations

import textwrap

# one MIG GPU (3g.40gb + 2x 1g.10gb) and three whole GPUs: three resources, mixed strategy
SMALL_NODE = textwrap.dedent(
    """
    name: rel-node
    nvlink: nvswitch
    numa_nodes: 2
    gpus:
      - model: A100-SXM4-80GB
        mig:
          instances: [3g.40gb, 1g.10gb, 1g.10gb]
      - model: A100-SXM4-80GB
        count: 3
    """
)
SMALL_RESOURCES = {"nvidia.com/gpu": 3, "nvidia.com/mig-1g.10gb": 2, "nvidia.com/mig-3g.40gb": 1}

# dgx-a100-like: GPUs 0-1 MIG 7x 1g.10gb, GPUs 2-7 whole
DGX_NODE = textwrap.dedent(
    """
    name: dgx-a100-mig
    nvlink: nvswitch
    numa_nodes: 2
    gpus:
      - model: A100-SXM4-80GB
        count: 2
        mig:
          instances: [1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb]
      - model: A100-SXM4-80GB
        count: 6
    """
)
# the 14 MIG devices time-sliced x2, GPUs 4-7 time-sliced x4; GPUs 2-3 stay whole (dedicated, never shared)
DGX_CONFIG = textwrap.dedent(
    """
    version: v1
    flags: {migStrategy: mixed}
    sharing:
      timeSlicing:
        renameByDefault: true
        resources:
          - name: nvidia.com/mig-1g.10gb
            replicas: 2
          - name: nvidia.com/gpu
            replicas: 4
            devices: [4, 5, 6, 7]
    """
)
DGX_RESOURCES = {"nvidia.com/gpu": 2, "nvidia.com/gpu.shared": 16, "nvidia.com/mig-1g.10gb.shared": 28}

MPS_NODE = "name: mps-node\ngpus:\n  - model: A100-SXM4-80GB\n    count: 2\n"
MPS_CONFIG = textwrap.dedent(
    """
    version: v1
    sharing:
      mps:
        resources:
          - name: nvidia.com/gpu
            replicas: 4
            memoryLimit: 10Gi
            activeThreadPercentage: 25
    """
)
MPS_RESOURCES = {"nvidia.com/gpu": 8}

FOUR_GPUS = "name: four\ngpus:\n  - model: A100-SXM4-80GB\n    count: 4\n"
