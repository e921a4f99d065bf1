"""The simulated node: a GPU driver beneath pynvml (and, in later issues, a kubelet and an MPS emulator).

Nothing above pynvml knows it is simulated: ``install`` hands pynvml a library object that answers the
same C symbols ``libnvidia-ml.so.1`` exports, writing into the same ctypes structs and returning the same
``nvmlReturn_t`` codes.
"""
