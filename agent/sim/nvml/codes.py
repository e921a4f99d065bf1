"""``nvmlReturn_t`` values, error strings and event bits, as ``nvml.h`` defines them.

The simulator speaks these numbers because pynvml turns them into its ``NVMLError_*`` classes exactly
as it does for the real library.
"""

from __future__ import annotations

from enum import IntEnum


class Return(IntEnum):
    SUCCESS = 0
    ERROR_UNINITIALIZED = 1
    ERROR_INVALID_ARGUMENT = 2
    ERROR_NOT_SUPPORTED = 3
    ERROR_NO_PERMISSION = 4
    ERROR_ALREADY_INITIALIZED = 5
    ERROR_NOT_FOUND = 6
    ERROR_INSUFFICIENT_SIZE = 7
    ERROR_INSUFFICIENT_POWER = 8
    ERROR_DRIVER_NOT_LOADED = 9
    ERROR_TIMEOUT = 10
    ERROR_IRQ_ISSUE = 11
    ERROR_LIBRARY_NOT_FOUND = 12
    ERROR_FUNCTION_NOT_FOUND = 13
    ERROR_CORRUPTED_INFOROM = 14
    ERROR_GPU_IS_LOST = 15
    ERROR_RESET_REQUIRED = 16
    ERROR_OPERATING_SYSTEM = 17
    ERROR_LIB_RM_VERSION_MISMATCH = 18
    ERROR_IN_USE = 19
    ERROR_MEMORY = 20
    ERROR_NO_DATA = 21
    ERROR_VGPU_ECC_NOT_SUPPORTED = 22
    ERROR_INSUFFICIENT_RESOURCES = 23
    ERROR_FREQ_NOT_SUPPORTED = 24
    ERROR_ARGUMENT_VERSION_MISMATCH = 25
    ERROR_DEPRECATED = 26
    ERROR_NOT_READY = 27
    ERROR_GPU_NOT_FOUND = 28
    ERROR_INVALID_STATE = 29
    ERROR_UNKNOWN = 999


ERROR_STRINGS: dict[int, bytes] = {
    Return.SUCCESS: b"Success",
    Return.ERROR_UNINITIALIZED: b"Uninitialized",
    Return.ERROR_INVALID_ARGUMENT: b"Invalid Argument",
    Return.ERROR_NOT_SUPPORTED: b"Not Supported",
    Return.ERROR_NO_PERMISSION: b"Insufficient Permissions",
    Return.ERROR_ALREADY_INITIALIZED: b"Already Initialized",
    Return.ERROR_NOT_FOUND: b"Not Found",
    Return.ERROR_INSUFFICIENT_SIZE: b"Insufficient Size",
    Return.ERROR_INSUFFICIENT_POWER: b"Insufficient External Power",
    Return.ERROR_DRIVER_NOT_LOADED: b"Driver Not Loaded",
    Return.ERROR_TIMEOUT: b"Timeout",
    Return.ERROR_IRQ_ISSUE: b"Interrupt Request Issue",
    Return.ERROR_LIBRARY_NOT_FOUND: b"NVML Shared Library Not Found",
    Return.ERROR_FUNCTION_NOT_FOUND: b"Function Not Found",
    Return.ERROR_CORRUPTED_INFOROM: b"Corrupted infoROM",
    Return.ERROR_GPU_IS_LOST: b"GPU is lost",
    Return.ERROR_RESET_REQUIRED: b"GPU requires restart",
    Return.ERROR_OPERATING_SYSTEM: b"The operating system has blocked the request.",
    Return.ERROR_LIB_RM_VERSION_MISMATCH: b"Driver/library version mismatch",
    Return.ERROR_IN_USE: b"In use by another client",
    Return.ERROR_MEMORY: b"Insufficient Memory",
    Return.ERROR_NO_DATA: b"No data",
    Return.ERROR_INSUFFICIENT_RESOURCES: b"Insufficient Resources",
    Return.ERROR_ARGUMENT_VERSION_MISMATCH: b"Argument version mismatch",
    Return.ERROR_UNKNOWN: b"Unknown Error",
}

# Event type bits (nvmlEventType*).
EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_PSTATE = 0x4
EVENT_XID_CRITICAL = 0x8
EVENT_CLOCK = 0x10
EVENT_MIG_CONFIG_CHANGE = 0x100

INVALID_INSTANCE_ID = 0xFFFFFFFF  # an event's GI/CI id when it is not attributable to one instance
XID_FALLEN_OFF_THE_BUS = 79

# Struct versions the *V / _v2 calls insist on.
GPU_INSTANCE_PROFILE_INFO_V2 = 0x02000098
COMPUTE_INSTANCE_PROFILE_INFO_V2 = 0x02000088
MEMORY_V2 = 0x02000028
ADDRESSING_MODE_V1 = 0x01000008

GPU_INSTANCE_PROFILE_COUNT = 0x12
COMPUTE_INSTANCE_PROFILE_COUNT = 0x9
NVLINK_MAX_LINKS = 36

COMPUTE_MODES = {0: "DEFAULT", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}  # 1 (EXCLUSIVE_THREAD) was removed

# NVML_TOPOLOGY_* levels.
TOPOLOGY_INTERNAL = 0
TOPOLOGY_SINGLE = 10
TOPOLOGY_NODE = 40
TOPOLOGY_SYSTEM = 50

P2P_CAPS_INDEX_NVLINK = 2
P2P_STATUS_OK = 0
P2P_STATUS_NOT_SUPPORTED = 5

# NVML_DEVICE_ARCH_*: row remapping replaced page retirement with Ampere.
ARCH_AMPERE = 7

# nvmlDeviceGetFieldValues: field ids (NVML_FI_DEV_*) the simulator answers, and nvmlValueType_t.
FI_ECC_CURRENT = 1
FI_ECC_PENDING = 2
FI_ECC_SBE_VOL_TOTAL = 3
FI_ECC_DBE_VOL_TOTAL = 4
FI_ECC_SBE_AGG_TOTAL = 5
FI_ECC_DBE_AGG_TOTAL = 6
FI_RETIRED_SBE = 29
FI_RETIRED_DBE = 30
FI_RETIRED_PENDING = 31
FI_REMAPPED_COR = 142
FI_REMAPPED_UNC = 143
FI_REMAPPED_PENDING = 144
FI_REMAPPED_FAILURE = 145
FI_GPU_RECOVERY_ACTION = 230  # in the headers from R570; the facts put the minimum driver at R565
RECOVERY_ACTION_MIN_DRIVER = 565

VALUE_TYPE_DOUBLE = 0
VALUE_TYPE_UINT = 1
VALUE_TYPE_ULONGLONG = 3

# nvmlDeviceGetTotalEccErrors arguments.
MEMORY_ERROR_CORRECTED = 0
MEMORY_ERROR_UNCORRECTED = 1
ECC_COUNTER_VOLATILE = 0
ECC_COUNTER_AGGREGATE = 1
