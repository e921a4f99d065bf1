"""Stands in for NVIDIA's ``nvidia-cuda-mps-control`` (the Legacy MPS v2 control daemon and its client).

``control`` is an executable emulator, stdlib only, run as ``python -m agent.sim.mps.control`` or as the console
script ``tessera-sim-mps-control``; tests put it on ``PATH`` under the real name, and it speaks over a real unix
socket between real processes, so code driving ``nvidia-cuda-mps-control`` cannot tell the difference.
"""
