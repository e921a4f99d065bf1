"""A stand-in for ``nvidia-smi``, for the one command the agent runs: ``compute-policy -i <UUID> --set-timeslice N``.

NVML has no call for a GPU's compute time-slice; NVIDIA's DRA driver runs ``nvidia-smi compute-policy`` for it, and
so does Tessera. This emulator does it to a simulated node: it reaches the node through the control socket of
``tessera run --simulate … --sim-control PATH`` (or a test's ``SimControlServer``), named by ``TESSERA_SIM_CONTROL``.
Run it as ``python -m agent.sim.smi`` under the name ``nvidia-smi`` (a launcher on ``PATH``).

Exit statuses as nvidia-smi's: 0 done, 2 a bad argument, 3 not supported, 6 no such device, 9 no driver.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from agent.sim.nvml.control import SimControlClient

SOCKET_ENV = "TESSERA_SIM_CONTROL"
INVALID_ARGUMENT, NOT_SUPPORTED, NOT_FOUND, NO_DRIVER = 2, 3, 6, 9


def main(argv: Sequence[str]) -> int:
    if len(argv) != 5 or argv[0] != "compute-policy" or argv[1] != "-i" or argv[3] != "--set-timeslice":
        print(f"Invalid combination of input arguments: {' '.join(argv)}", file=sys.stderr)
        print("This emulator knows only: compute-policy -i <UUID> --set-timeslice <0-3>", file=sys.stderr)
        return INVALID_ARGUMENT
    uuid, level = argv[2], argv[4]
    if level not in ("0", "1", "2", "3"):
        print(f'Invalid timeslice value "{level}": 0 (default), 1 (short), 2 (medium) or 3 (long)', file=sys.stderr)
        return INVALID_ARGUMENT
    path = os.environ.get(SOCKET_ENV)
    if not path:
        print(
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", file=sys.stderr
        )  # no simulated node to reach
        return NO_DRIVER
    control = SimControlClient(path)
    try:
        control.call("set_timeslice", uuid=uuid, level=int(level))
    except RuntimeError as error:
        text = str(error)
        if "no GPU" in text or "not found" in text.lower() or "NOT_FOUND" in text:
            print(f"No devices were found matching {uuid}", file=sys.stderr)
            return NOT_FOUND
        if "NOT_SUPPORTED" in text or "cannot be set" in text:
            print(f"Setting the timeslice is not supported for GPU {uuid}.", file=sys.stderr)
            return NOT_SUPPORTED
        print(f"Failed to set the timeslice for GPU {uuid}: {text}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver: {error}", file=sys.stderr)
        return NO_DRIVER
    print(f"Set compute policy timeslice to {level} for GPU {uuid}.")
    print("All done.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
