"""The simulated ``libnvidia-ml.so.1``: the C symbols pynvml calls, answering from a ``SimDriver``.

pynvml looks each function up by name on its library object and calls it with ctypes arguments: plain
ints or ``c_uint``s in, ``byref(...)`` out-params, string buffers, arrays, opaque handle pointers. Every
function here takes exactly those arguments, writes its results through them the way the C library does,
and returns an ``nvmlReturn_t`` code. Handles are opaque addresses that this library hands out and
resolves; a handle of a destroyed instance stays invalid, as on the real driver.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from agent.sim.nvml.codes import (
    ADDRESSING_MODE_V1,
    COMPUTE_INSTANCE_PROFILE_INFO_V2,
    ERROR_STRINGS,
    GPU_INSTANCE_PROFILE_INFO_V2,
    MEMORY_V2,
    NVLINK_MAX_LINKS,
    P2P_CAPS_INDEX_NVLINK,
    P2P_STATUS_NOT_SUPPORTED,
    P2P_STATUS_OK,
    TOPOLOGY_INTERNAL,
    TOPOLOGY_NODE,
    TOPOLOGY_SINGLE,
    TOPOLOGY_SYSTEM,
    VALUE_TYPE_DOUBLE,
    VALUE_TYPE_UINT,
    VALUE_TYPE_ULONGLONG,
    Return,
)
from agent.sim.nvml.driver import (
    COMPUTE_LIST_KINDS,
    MPS_LIST_KINDS,
    NvmlFault,
    SimComputeInstance,
    SimDriver,
    SimGpuInstance,
)

_MIB = 1 << 20
_SUCCESS = int(Return.SUCCESS)
_UNINITIALIZED = int(Return.ERROR_UNINITIALIZED)
_Impl = Callable[..., Any]
_EXPORTS: dict[str, _Impl] = {}
_CALLABLE_BEFORE_INIT = {"nvmlInitWithFlags", "nvmlInit_v2", "nvmlErrorString"}
_RETURNS_VALUE = {"nvmlErrorString"}  # returns a char*, not an nvmlReturn_t
_MEMORY_LIMIT_SYMBOLS = frozenset({"nvmlDeviceSetMemoryLimits_v1", "nvmlDeviceGetMemoryLimits_v1"})


def _export(*symbols: str) -> Callable[[_Impl], _Impl]:
    def register(impl: _Impl) -> _Impl:
        for symbol in symbols:
            _EXPORTS[symbol] = impl
        return impl

    return register


# ----- ctypes plumbing -----------------------------------------------------------------------------


def _value(arg: Any) -> Any:
    """A C scalar argument as Python: pynvml passes plain ints or ctypes scalars."""
    return arg.value if hasattr(arg, "value") and not isinstance(arg, int) else arg


def _target(ref: Any) -> Any:
    """What an out-param points at: ``byref(x)`` arrives as a CArgObject whose ``_obj`` is ``x``."""
    if ref is None:
        raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, "NULL out-parameter")
    return ref._obj if hasattr(ref, "_obj") else ref


def _struct_in(ref: Any) -> Any:
    """A struct passed by pointer as input (``byref(s)`` or ``pointer(s)``)."""
    if hasattr(ref, "_obj"):
        return ref._obj
    if hasattr(ref, "contents"):
        return ref.contents
    return ref


def _set(ref: Any, value: Any) -> None:
    _target(ref).value = value


def _write_address(address_of_slot: int, handle: int) -> None:
    ctypes.c_void_p.from_address(address_of_slot).value = handle


def _set_string(buffer: Any, length: Any, text: str) -> None:
    data = text.encode()
    if len(data) + 1 > _value(length):
        raise NvmlFault(Return.ERROR_INSUFFICIENT_SIZE, "buffer too small")
    buffer.value = data


def _check_version(struct: Any, expected: int) -> None:
    if struct.version != expected:
        raise NvmlFault(Return.ERROR_ARGUMENT_VERSION_MISMATCH, f"struct version {struct.version:#x}")


class _HandleTable:
    """Opaque handles: one small allocation per object, its address is the handle value."""

    def __init__(self) -> None:
        self._by_address: dict[int, tuple[Any, ...]] = {}
        self._address_by_key: dict[Any, int] = {}
        self._memory: list[ctypes.Array[ctypes.c_char]] = []

    def address(self, key: Any, target: tuple[Any, ...]) -> int:
        if key not in self._address_by_key:
            cell = ctypes.create_string_buffer(8)
            self._memory.append(cell)
            address = ctypes.addressof(cell)
            self._address_by_key[key] = address
            self._by_address[address] = target
        return self._address_by_key[key]

    def resolve(self, handle: Any) -> tuple[Any, ...]:
        try:  # pynvml passes its handle types, ctypes pointers: the cheap way to their address
            address: int | None = ctypes.addressof(handle.contents)
        except (AttributeError, TypeError, ValueError):  # not a pointer (or NULL): the general way
            address = ctypes.cast(handle, ctypes.c_void_p).value if handle is not None else None
        if not address or address not in self._by_address:
            raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, "invalid handle")
        return self._by_address[address]


class SimulatedNvmlLibrary:
    """One attribute per exported C symbol; each is a plain function, as pynvml requires."""

    def __init__(self, driver: SimDriver) -> None:
        self.driver = driver
        self._handles = _HandleTable()
        for symbol, impl in _EXPORTS.items():
            if symbol in _MEMORY_LIMIT_SYMBOLS and not driver.has_memory_limits:
                continue  # an older driver has no such symbol: pynvml says FUNCTION_NOT_FOUND
            setattr(self, symbol, self._c_function(symbol, impl))

    def _c_function(self, symbol: str, impl: _Impl) -> Callable[..., Any]:
        def c_function(*args: Any) -> Any:
            return self._call(symbol, impl, args)

        c_function.__name__ = symbol
        return c_function

    def _call(self, symbol: str, impl: _Impl, args: tuple[Any, ...]) -> Any:
        if symbol in _RETURNS_VALUE:
            return impl(self, *args)
        driver = self.driver
        try:
            if driver.init_count == 0 and symbol not in _CALLABLE_BEFORE_INIT:
                return _UNINITIALIZED
            driver.calls[symbol] += 1
            if driver.faults_armed:  # else there is nothing to take: skip resolving the handle for it
                if stalled := driver.take_stall(symbol):
                    threading.Event().wait(stalled)  # the call blocks in the driver, as a slow real one does
                injected = driver.take_injected_fault(symbol, self._gpu_index_of(args))
                if injected is None:
                    injected = driver.take_random_fault(symbol)
                if injected is not None:
                    return int(injected)
            result = impl(self, *args)
        except NvmlFault as fault:
            return int(fault.code)
        return _SUCCESS if result is None else int(result)

    def _gpu_index_of(self, args: tuple[Any, ...]) -> int | None:
        try:
            target = self._handles.resolve(args[0]) if args else None
        except (NvmlFault, ctypes.ArgumentError, TypeError):
            return None
        return target[1] if target and target[0] in ("gpu", "mig", "gi", "ci") else None

    # ----- handles -----------------------------------------------------------------------------

    def gpu_handle(self, index: int) -> int:
        return self._handles.address(("gpu", index), ("gpu", index))

    def mig_handle(self, index: int, gi: SimGpuInstance, ci: SimComputeInstance) -> int:
        return self._handles.address(("mig", ci), ("mig", index, gi, ci))

    def gi_handle(self, index: int, gi: SimGpuInstance) -> int:
        return self._handles.address(("gi", gi), ("gi", index, gi))

    def ci_handle(self, index: int, gi: SimGpuInstance, ci: SimComputeInstance) -> int:
        return self._handles.address(("ci", ci), ("ci", index, gi, ci))

    def device(self, handle: Any) -> tuple[int, tuple[SimGpuInstance, SimComputeInstance] | None]:
        """A device handle: (GPU index, None) for a GPU, (GPU index, (gi, ci)) for a MIG device."""
        target = self._handles.resolve(handle)
        if target[0] == "gpu":
            self.driver.gpu(target[1])
            return target[1], None
        if target[0] == "mig":
            _, index, gi, ci = target
            self.driver.live_ci(index, gi, ci)
            return index, (gi, ci)
        raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, "not a device handle")

    def gpu_index(self, handle: Any) -> int:
        index, mig = self.device(handle)
        if mig is not None:
            raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, "a MIG device handle where a GPU handle is needed")
        return index

    def gpu_instance(self, handle: Any) -> tuple[int, SimGpuInstance]:
        target = self._handles.resolve(handle)
        if target[0] != "gi":
            raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, "not a GPU instance handle")
        _, index, gi = target
        return index, self.driver.live_gi(index, gi)

    def compute_instance(self, handle: Any) -> tuple[int, SimGpuInstance, SimComputeInstance]:
        target = self._handles.resolve(handle)
        if target[0] != "ci":
            raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, "not a compute instance handle")
        _, index, gi, ci = target
        return index, gi, self.driver.live_ci(index, gi, ci)

    def event_set(self, handle: Any) -> Any:
        target = self._handles.resolve(handle)
        if target[0] != "es":
            raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, "not an event set handle")
        return target[1]


# ----- init and system ------------------------------------------------------------------------------


@_export("nvmlInitWithFlags", "nvmlInit_v2")
def _init(lib: SimulatedNvmlLibrary, flags: Any = 0) -> None:
    with lib.driver.lock:
        failure = lib.driver.take_init_failure()
        if failure is not None:
            raise NvmlFault(failure, "nvmlInit failed as the test asked")
        lib.driver.init_count += 1


@_export("nvmlShutdown")
def _shutdown(lib: SimulatedNvmlLibrary) -> None:
    with lib.driver.lock:
        lib.driver.init_count = max(0, lib.driver.init_count - 1)


@_export("nvmlErrorString")
def _error_string(lib: SimulatedNvmlLibrary, code: Any) -> bytes:
    return ERROR_STRINGS.get(_value(code), b"Unknown Error")


@_export("nvmlSystemGetDriverVersion")
def _driver_version(lib: SimulatedNvmlLibrary, buffer: Any, length: Any) -> None:
    _set_string(buffer, length, lib.driver.driver_version)


@_export("nvmlSystemGetNVMLVersion")
def _nvml_version(lib: SimulatedNvmlLibrary, buffer: Any, length: Any) -> None:
    _set_string(buffer, length, lib.driver.nvml_version)


@_export("nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2")
def _cuda_version(lib: SimulatedNvmlLibrary, out: Any) -> None:
    _set(out, lib.driver.cuda_driver_version)


# ----- device enumeration and identity -------------------------------------------------------------


@_export("nvmlDeviceGetCount_v2")
def _device_count(lib: SimulatedNvmlLibrary, out: Any) -> None:
    _set(out, len(lib.driver.gpus))


@_export("nvmlDeviceGetHandleByIndex_v2")
def _handle_by_index(lib: SimulatedNvmlLibrary, index: Any, out: Any) -> None:
    gpu = lib.driver.gpu(_value(index))
    _write_address(ctypes.addressof(_target(out)), lib.gpu_handle(gpu.index))


@_export("nvmlDeviceGetHandleByUUID")
def _handle_by_uuid(lib: SimulatedNvmlLibrary, uuid: Any, out: Any) -> None:
    text = _value(uuid)
    index, gi, ci = lib.driver.find_uuid(text.decode() if isinstance(text, bytes) else str(text))
    handle = lib.gpu_handle(index) if gi is None or ci is None else lib.mig_handle(index, gi, ci)
    _write_address(ctypes.addressof(_target(out)), handle)


@_export("nvmlDeviceGetHandleByPciBusId_v2")
def _handle_by_bus_id(lib: SimulatedNvmlLibrary, bus_id: Any, out: Any) -> None:
    text = _value(bus_id)
    index = lib.driver.find_bus_id(text.decode() if isinstance(text, bytes) else str(text))
    _write_address(ctypes.addressof(_target(out)), lib.gpu_handle(index))


@_export("nvmlDeviceGetUUID")
def _uuid(lib: SimulatedNvmlLibrary, handle: Any, buffer: Any, length: Any) -> None:
    index, mig = lib.device(handle)
    _set_string(buffer, length, mig[1].uuid if mig else lib.driver.gpus[index].uuid)


@_export("nvmlDeviceGetName")
def _name(lib: SimulatedNvmlLibrary, handle: Any, buffer: Any, length: Any) -> None:
    index, mig = lib.device(handle)
    name = lib.driver.gpus[index].model.nvml_name
    if mig:
        gi, ci = mig
        prefix = "" if ci.profile.slice_count == gi.profile.slice_count else f"{ci.profile.slice_count}c."
        name = f"{name} MIG {prefix}{gi.profile.name}"
    _set_string(buffer, length, name)


@_export("nvmlDeviceGetSerial")
def _serial(lib: SimulatedNvmlLibrary, handle: Any, buffer: Any, length: Any) -> None:
    _set_string(buffer, length, lib.driver.gpus[lib.gpu_index(handle)].serial)


@_export("nvmlDeviceGetIndex")
def _index(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    _set(out, lib.gpu_index(handle))


@_export("nvmlDeviceGetMinorNumber")
def _minor(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    _set(out, lib.driver.gpus[lib.gpu_index(handle)].minor_number)


@_export("nvmlDeviceGetArchitecture")
def _architecture(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    index, _ = lib.device(handle)
    _set(out, lib.driver.gpus[index].model.architecture_id)


@_export("nvmlDeviceGetBrand")
def _brand(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    """``nvmlDeviceGetBrand(device, nvmlBrandType_t*)``; a MIG device answers with its GPU's brand."""
    index, _ = lib.device(handle)
    _set(out, lib.driver.gpus[index].model.brand)


@_export("nvmlDeviceGetPciInfo_v3")
def _pci_info(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    index, _ = lib.device(handle)
    gpu = lib.driver.gpus[index]
    _fill_pci(_target(out), gpu.pci_bus_id, gpu.model.pci_device_id)


def _fill_pci(info: Any, bus_id: str, device_id: int, subsystem_id: int = 0) -> None:
    domain, bus, devfn = bus_id.split(":")
    info.busId = bus_id.encode()
    info.busIdLegacy = f"{domain[-4:]}:{bus}:{devfn}".encode()
    info.domain = int(domain, 16)
    info.bus = int(bus, 16)
    info.device = int(devfn.split(".")[0], 16)
    info.pciDeviceId = device_id
    info.pciSubSystemId = subsystem_id


@_export("nvmlDeviceGetCudaComputeCapability")
def _compute_capability(lib: SimulatedNvmlLibrary, handle: Any, major: Any, minor: Any) -> None:
    index, _ = lib.device(handle)
    cc = lib.driver.gpus[index].model.compute_capability
    _set(major, cc[0])
    _set(minor, cc[1])


@_export("nvmlDeviceGetNumaNodeId")
def _numa_node(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    _set(out, lib.driver.gpus[lib.gpu_index(handle)].numa_node)


@_export("nvmlDeviceGetAddressingMode")
def _addressing_mode(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    mode = lib.driver.gpus[lib.gpu_index(handle)].model.addressing_mode
    if mode is None:
        raise NvmlFault(Return.ERROR_NOT_SUPPORTED, "no addressing mode on this GPU")
    target = _target(out)
    _check_version(target, ADDRESSING_MODE_V1)
    target.value = mode


# ----- memory, utilization, processes, compute mode --------------------------------------------------


def _memory(lib: SimulatedNvmlLibrary, handle: Any) -> tuple[int, int]:
    index, mig = lib.device(handle)
    gpu = lib.driver.gpus[index]
    total = (mig[0].profile.memory_mib if mig else gpu.model.memory_mib) * _MIB
    used = lib.driver.used_memory_mib(index, mig) * _MIB
    return total, min(used, total)


@_export("nvmlDeviceGetMemoryInfo")
def _memory_info(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    info = _target(out)
    total, used = _memory(lib, handle)
    info.total, info.used, info.free = total, used, total - used


@_export("nvmlDeviceGetMemoryInfo_v2")
def _memory_info_v2(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    info = _target(out)
    _check_version(info, MEMORY_V2)
    total, used = _memory(lib, handle)
    info.total, info.used, info.reserved, info.free = total, used, 0, total - used


@_export("nvmlDeviceSetMemoryLimits_v1")
def _set_memory_limits(lib: SimulatedNvmlLibrary, handle: Any, limits: Any) -> None:
    """``nvmlDeviceSetMemoryLimits_v1(device, nvmlSetMemoryLimits_v1_t*)``: nameSpace, softLimit, hardLimit in."""
    index, mig = lib.device(handle)
    request = _struct_in(limits)
    lib.driver.set_memory_limits(index, mig, _namespace(request), request.softLimit, request.hardLimit)


@_export("nvmlDeviceGetMemoryLimits_v1")
def _get_memory_limits(lib: SimulatedNvmlLibrary, handle: Any, limits: Any) -> None:
    """``nvmlDeviceGetMemoryLimits_v1(device, nvmlGetMemoryLimits_v1_t*)``: nameSpace in; softLimit, hardLimit and
    currentUsed out."""
    index, mig = lib.device(handle)
    answer = _target(limits)
    answer.softLimit, answer.hardLimit, answer.currentUsed = lib.driver.memory_limits(index, mig, _namespace(answer))


def _namespace(struct: Any) -> str:
    raw = struct.nameSpace
    if not raw:
        raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, "NULL nameSpace")
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


@_export("nvmlDeviceGetUtilizationRates")
def _utilization(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    index, mig = lib.device(handle)
    if mig is not None:
        raise NvmlFault(Return.ERROR_NOT_SUPPORTED, "utilization is not reported per MIG device")
    info = _target(out)
    info.gpu, info.memory = lib.driver.utilization(index)


@_export("nvmlDeviceGetComputeRunningProcesses_v3")
def _compute_processes(lib: SimulatedNvmlLibrary, handle: Any, count: Any, infos: Any) -> Return:
    return _processes(lib, handle, count, infos, COMPUTE_LIST_KINDS)


@_export("nvmlDeviceGetMPSComputeRunningProcesses_v3")
def _mps_processes(lib: SimulatedNvmlLibrary, handle: Any, count: Any, infos: Any) -> Return:
    return _processes(lib, handle, count, infos, MPS_LIST_KINDS)


@_export("nvmlDeviceGetGraphicsRunningProcesses_v3")
def _graphics_processes(lib: SimulatedNvmlLibrary, handle: Any, count: Any, infos: Any) -> Return:
    return _processes(lib, handle, count, infos, ())  # a compute node runs no graphics


def _processes(lib: SimulatedNvmlLibrary, handle: Any, count: Any, infos: Any, kinds: Collection[str]) -> Return:
    index, mig = lib.device(handle)
    procs = lib.driver.processes(index, mig, kinds)
    capacity = _target(count).value
    _set(count, len(procs))
    if not procs:
        return Return.SUCCESS
    if infos is None or capacity < len(procs):
        return Return.ERROR_INSUFFICIENT_SIZE
    for slot, proc in zip(infos, procs, strict=False):
        slot.pid = proc.pid
        slot.usedGpuMemory = proc.used_mib * _MIB
        slot.gpuInstanceId = proc.gi_id
        slot.computeInstanceId = proc.ci_id
    lib.driver.listed(proc.pid for proc in procs)
    return Return.SUCCESS


@_export("nvmlDeviceGetProcessUtilization")
def _process_utilization(lib: SimulatedNvmlLibrary, handle: Any, samples: Any, count: Any, last_seen: Any) -> Return:
    """NVML's sizing protocol: a NULL buffer (or one too small) gets INSUFFICIENT_SIZE and the count needed; no
    process busy since ``last_seen`` (µs) is NOT_FOUND, asked with a buffer or without."""
    index, mig = lib.device(handle)
    found = lib.driver.process_utilization(index, mig, int(_value(last_seen)))
    if not found:
        return Return.ERROR_NOT_FOUND
    capacity = _target(count).value
    _set(count, len(found))
    if samples is None or capacity < len(found):
        return Return.ERROR_INSUFFICIENT_SIZE
    for slot, (pid, stamp, (sm, memory, encoder, decoder)) in zip(samples, found, strict=False):
        slot.pid, slot.timeStamp = pid, stamp
        slot.smUtil, slot.memUtil, slot.encUtil, slot.decUtil = sm, memory, encoder, decoder
    return Return.SUCCESS


@_export("nvmlDeviceGetComputeMode")
def _get_compute_mode(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    index, mig = lib.device(handle)
    gpu = lib.driver.gpus[index]
    if mig is None and gpu.mig_current:
        raise NvmlFault(Return.ERROR_NOT_SUPPORTED, "with MIG enabled the compute mode is per MIG device")
    _set(out, mig[1].compute_mode if mig else gpu.compute_mode)


@_export("nvmlDeviceSetComputeMode")
def _set_compute_mode(lib: SimulatedNvmlLibrary, handle: Any, mode: Any) -> None:
    index, mig = lib.device(handle)
    lib.driver.set_compute_mode(index, _value(mode), mig[1] if mig else None)


# ----- memory health ---------------------------------------------------------------------------------


@_export("nvmlDeviceGetFieldValues")
def _field_values(lib: SimulatedNvmlLibrary, handle: Any, count: Any, values: Any) -> None:
    """Fill each entry's ``nvmlReturn``, ``valueType`` and ``value``; the call itself succeeds.

    A MIG device handle answers no field (each entry NOT_SUPPORTED); a lost GPU fails the whole call.
    """
    index, mig = lib.device(handle)
    entries = _target(values)
    length = _value(count)
    if length <= 0:
        raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"{length} field values")
    now_us = int(time.time() * 1_000_000)
    for position in range(length):
        entry = entries[position]
        entry.timestamp, entry.latencyUsec = now_us, 0
        try:
            if mig is not None:
                raise NvmlFault(Return.ERROR_NOT_SUPPORTED, "no field values on a MIG device")
            value_type, value = lib.driver.field_value(index, entry.fieldId)
        except NvmlFault as fault:
            entry.nvmlReturn = int(fault.code)
            continue
        _set_field(entry, value_type, value)


def _set_field(entry: Any, value_type: int, value: int) -> None:
    member = {VALUE_TYPE_DOUBLE: "dVal", VALUE_TYPE_UINT: "uiVal", VALUE_TYPE_ULONGLONG: "ullVal"}[value_type]
    setattr(entry.value, member, value)
    entry.valueType = value_type
    entry.nvmlReturn = int(Return.SUCCESS)


@_export("nvmlDeviceGetRemappedRows")
def _remapped_rows(lib: SimulatedNvmlLibrary, handle: Any, corr: Any, unc: Any, pending: Any, failure: Any) -> None:
    rows = lib.driver.remapped_rows(lib.gpu_index(handle))
    for out, value in zip((corr, unc, pending, failure), rows, strict=True):
        _set(out, int(value))


@_export("nvmlDeviceGetRetiredPagesPendingStatus")
def _retired_pages_pending(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    _set(out, int(lib.driver.retired_pages_pending(lib.gpu_index(handle))))


@_export("nvmlDeviceGetRetiredPages")
def _retired_pages(lib: SimulatedNvmlLibrary, handle: Any, cause: Any, count: Any, addresses: Any) -> Return:
    if _value(cause) not in (0, 1):
        raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"page retirement cause {_value(cause)}")
    pages = lib.driver.retired_pages(lib.gpu_index(handle))
    capacity = _target(count).value
    _set(count, len(pages))
    if not pages:
        return Return.SUCCESS
    if addresses is None or capacity < len(pages):
        return Return.ERROR_INSUFFICIENT_SIZE
    for position, page in enumerate(pages):
        addresses[position] = page
    return Return.SUCCESS


@_export("nvmlDeviceGetTotalEccErrors")
def _total_ecc_errors(lib: SimulatedNvmlLibrary, handle: Any, error_type: Any, counter_type: Any, out: Any) -> None:
    _set(out, lib.driver.total_ecc_errors(lib.gpu_index(handle), _value(error_type), _value(counter_type)))


# ----- MIG mode and MIG device handles ---------------------------------------------------------------


@_export("nvmlDeviceGetMigMode")
def _get_mig_mode(lib: SimulatedNvmlLibrary, handle: Any, current: Any, pending: Any) -> None:
    gpu = lib.driver.gpus[lib.gpu_index(handle)]
    if not gpu.model.mig_capable:
        raise NvmlFault(Return.ERROR_NOT_SUPPORTED, f"{gpu.model.nvml_name} is not MIG capable")
    _set(current, int(gpu.mig_current))
    _set(pending, int(gpu.mig_pending))


@_export("nvmlDeviceSetMigMode")
def _set_mig_mode(lib: SimulatedNvmlLibrary, handle: Any, mode: Any, status: Any) -> None:
    requested = _value(mode)
    if requested not in (0, 1):
        raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"MIG mode {requested}")
    _set(status, int(lib.driver.set_mig_mode(lib.gpu_index(handle), bool(requested))))


@_export("nvmlDeviceGetMaxMigDeviceCount")
def _max_mig_devices(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    _set(out, lib.driver.max_mig_device_count(lib.gpu_index(handle)))


@_export("nvmlDeviceGetMigDeviceHandleByIndex")
def _mig_handle_by_index(lib: SimulatedNvmlLibrary, handle: Any, mig_index: Any, out: Any) -> None:
    index = lib.gpu_index(handle)
    position = _value(mig_index)
    if position >= lib.driver.max_mig_device_count(index):
        raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"MIG index {position} out of range")
    devices = lib.driver.gpus[index].mig_devices()
    if position >= len(devices):
        raise NvmlFault(Return.ERROR_NOT_FOUND, f"no MIG device at index {position}")
    gi, ci = devices[position]
    _write_address(ctypes.addressof(_target(out)), lib.mig_handle(index, gi, ci))


@_export("nvmlDeviceIsMigDeviceHandle")
def _is_mig_handle(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    _, mig = lib.device(handle)
    _set(out, int(mig is not None))


def _mig_of(lib: SimulatedNvmlLibrary, handle: Any) -> tuple[int, SimGpuInstance, SimComputeInstance]:
    index, mig = lib.device(handle)
    if mig is None:
        raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, "not a MIG device handle")
    return index, mig[0], mig[1]


@_export("nvmlDeviceGetGpuInstanceId")
def _mig_gi_id(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    _set(out, _mig_of(lib, handle)[1].id)


@_export("nvmlDeviceGetComputeInstanceId")
def _mig_ci_id(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    _set(out, _mig_of(lib, handle)[2].id)


@_export("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
def _mig_parent(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    index, _, _ = _mig_of(lib, handle)
    _write_address(ctypes.addressof(_target(out)), lib.gpu_handle(index))


@_export("nvmlDeviceGetAttributes_v2")
def _attributes(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    _, gi, ci = _mig_of(lib, handle)
    attrs = _target(out)
    attrs.multiprocessorCount = ci.profile.multiprocessor_count
    attrs.sharedCopyEngineCount = gi.profile.copy_engine_count
    attrs.sharedDecoderCount = gi.profile.decoder_count
    attrs.sharedEncoderCount = gi.profile.encoder_count
    attrs.sharedJpegCount = gi.profile.jpeg_count
    attrs.sharedOfaCount = gi.profile.ofa_count
    attrs.gpuInstanceSliceCount = gi.profile.slice_count
    attrs.computeInstanceSliceCount = ci.profile.slice_count
    attrs.memorySizeMB = gi.profile.memory_mib


# ----- GPU instances --------------------------------------------------------------------------------


def _fill_gi_profile(info: Any, profile: Any, *, versioned: bool) -> None:
    if versioned:
        _check_version(info, GPU_INSTANCE_PROFILE_INFO_V2)
        info.name = f"MIG {profile.name}".encode()
    info.id = profile.id
    info.isP2pSupported = int(profile.p2p_supported)
    info.sliceCount = profile.slice_count
    info.instanceCount = profile.instance_count
    info.multiprocessorCount = profile.multiprocessor_count
    info.copyEngineCount = profile.copy_engine_count
    info.decoderCount = profile.decoder_count
    info.encoderCount = profile.encoder_count
    info.jpegCount = profile.jpeg_count
    info.ofaCount = profile.ofa_count
    info.memorySizeMB = profile.memory_mib


@_export("nvmlDeviceGetGpuInstanceProfileInfoV")
def _gi_profile_info_v(lib: SimulatedNvmlLibrary, handle: Any, profile_index: Any, out: Any) -> None:
    profile = lib.driver.gi_profile_by_index(lib.gpu_index(handle), _value(profile_index))
    _fill_gi_profile(_target(out), profile, versioned=True)


@_export("nvmlDeviceGetGpuInstanceProfileInfo")
def _gi_profile_info(lib: SimulatedNvmlLibrary, handle: Any, profile_index: Any, out: Any) -> None:
    profile = lib.driver.gi_profile_by_index(lib.gpu_index(handle), _value(profile_index))
    _fill_gi_profile(_target(out), profile, versioned=False)


@_export("nvmlDeviceGetGpuInstanceProfileInfoByIdV")
def _gi_profile_info_by_id(lib: SimulatedNvmlLibrary, handle: Any, profile_id: Any, out: Any) -> None:
    profile = lib.driver.gi_profile_by_id(lib.gpu_index(handle), _value(profile_id))
    _fill_gi_profile(_target(out), profile, versioned=True)


@_export("nvmlDeviceGetGpuInstanceRemainingCapacity")
def _gi_remaining(lib: SimulatedNvmlLibrary, handle: Any, profile_id: Any, out: Any) -> None:
    _set(out, lib.driver.gi_remaining_capacity(lib.gpu_index(handle), _value(profile_id)))


def _fill_placements(placements: list[tuple[int, int]], array: Any, count: Any) -> Return:
    capacity = _target(count).value
    _set(count, len(placements))
    if array is None:
        return Return.SUCCESS
    if capacity < len(placements):
        return Return.ERROR_INSUFFICIENT_SIZE
    for slot, (start, size) in zip(array, placements, strict=False):
        slot.start, slot.size = start, size
    return Return.SUCCESS


@_export("nvmlDeviceGetGpuInstancePossiblePlacements_v2")
def _gi_placements(lib: SimulatedNvmlLibrary, handle: Any, profile_id: Any, array: Any, count: Any) -> Return:
    placements = lib.driver.gi_possible_placements(lib.gpu_index(handle), _value(profile_id))
    return _fill_placements(placements, array, count)


@_export("nvmlDeviceCreateGpuInstance")
def _create_gi(lib: SimulatedNvmlLibrary, handle: Any, profile_id: Any, out: Any) -> None:
    index = lib.gpu_index(handle)
    gi = lib.driver.create_gpu_instance(index, _value(profile_id))
    _write_address(ctypes.addressof(_target(out)), lib.gi_handle(index, gi))


@_export("nvmlDeviceCreateGpuInstanceWithPlacement")
def _create_gi_placed(lib: SimulatedNvmlLibrary, handle: Any, profile_id: Any, placement: Any, out: Any) -> None:
    index = lib.gpu_index(handle)
    where = _struct_in(placement)
    gi = lib.driver.create_gpu_instance(index, _value(profile_id), (where.start, where.size))
    _write_address(ctypes.addressof(_target(out)), lib.gi_handle(index, gi))


def _fill_handles(handles: list[int], array: Any, count: Any) -> Return:
    capacity = _target(count).value
    _set(count, len(handles))
    if array is None or capacity < len(handles):
        return Return.ERROR_INSUFFICIENT_SIZE if handles else Return.SUCCESS
    base = ctypes.addressof(array)
    for position, handle in enumerate(handles):
        _write_address(base + position * ctypes.sizeof(ctypes.c_void_p), handle)
    return Return.SUCCESS


@_export("nvmlDeviceGetGpuInstances")
def _gpu_instances(lib: SimulatedNvmlLibrary, handle: Any, profile_id: Any, array: Any, count: Any) -> Return:
    index = lib.gpu_index(handle)
    gis = lib.driver.gpu_instances(index, _value(profile_id))
    return _fill_handles([lib.gi_handle(index, gi) for gi in gis], array, count)


@_export("nvmlDeviceGetGpuInstanceById")
def _gpu_instance_by_id(lib: SimulatedNvmlLibrary, handle: Any, gi_id: Any, out: Any) -> None:
    index = lib.gpu_index(handle)
    gi = lib.driver.gpu_instance_by_id(index, _value(gi_id))
    _write_address(ctypes.addressof(_target(out)), lib.gi_handle(index, gi))


def _write_pointer_field(struct: Any, name: str, handle: int) -> None:
    _write_address(ctypes.addressof(struct) + getattr(type(struct), name).offset, handle)


@_export("nvmlGpuInstanceGetInfo")
def _gi_info(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    index, gi = lib.gpu_instance(handle)
    info = _target(out)
    _write_pointer_field(info, "device", lib.gpu_handle(index))
    info.id = gi.id
    info.profileId = gi.profile.id
    info.placement.start, info.placement.size = gi.placement


@_export("nvmlGpuInstanceDestroy")
def _destroy_gi(lib: SimulatedNvmlLibrary, handle: Any) -> None:
    index, gi = lib.gpu_instance(handle)
    lib.driver.destroy_gpu_instance(index, gi)


# ----- compute instances ----------------------------------------------------------------------------


def _fill_ci_profile(info: Any, gi: SimGpuInstance, profile: Any, *, versioned: bool) -> None:
    if versioned:
        _check_version(info, COMPUTE_INSTANCE_PROFILE_INFO_V2)
        prefix = "" if profile.slice_count == gi.profile.slice_count else f"{profile.slice_count}c."
        info.name = f"MIG {prefix}{gi.profile.name}".encode()
    info.id = profile.id
    info.sliceCount = profile.slice_count
    info.instanceCount = profile.instance_count
    info.multiprocessorCount = profile.multiprocessor_count
    info.sharedCopyEngineCount = gi.profile.copy_engine_count
    info.sharedDecoderCount = gi.profile.decoder_count
    info.sharedEncoderCount = gi.profile.encoder_count
    info.sharedJpegCount = gi.profile.jpeg_count
    info.sharedOfaCount = gi.profile.ofa_count


def _ci_profile_info(
    lib: SimulatedNvmlLibrary, handle: Any, profile_index: Any, engine: Any, out: Any, *, versioned: bool
) -> None:
    index, gi = lib.gpu_instance(handle)
    if _value(engine) != 0:
        raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, "only the shared engine profile exists")
    profile = lib.driver.ci_profile_by_index(index, gi, _value(profile_index))
    _fill_ci_profile(_target(out), gi, profile, versioned=versioned)


@_export("nvmlGpuInstanceGetComputeInstanceProfileInfoV")
def _ci_profile_info_v(lib: SimulatedNvmlLibrary, handle: Any, profile_index: Any, engine: Any, out: Any) -> None:
    _ci_profile_info(lib, handle, profile_index, engine, out, versioned=True)


@_export("nvmlGpuInstanceGetComputeInstanceProfileInfo")
def _ci_profile_info_v1(lib: SimulatedNvmlLibrary, handle: Any, profile_index: Any, engine: Any, out: Any) -> None:
    _ci_profile_info(lib, handle, profile_index, engine, out, versioned=False)


@_export("nvmlGpuInstanceGetComputeInstanceRemainingCapacity")
def _ci_remaining(lib: SimulatedNvmlLibrary, handle: Any, profile_id: Any, out: Any) -> None:
    index, gi = lib.gpu_instance(handle)
    _set(out, lib.driver.ci_remaining_capacity(index, gi, _value(profile_id)))


@_export("nvmlGpuInstanceGetComputeInstancePossiblePlacements")
def _ci_placements(lib: SimulatedNvmlLibrary, handle: Any, profile_id: Any, array: Any, count: Any) -> Return:
    index, gi = lib.gpu_instance(handle)
    profile = lib.driver.ci_profile_by_id(index, gi, _value(profile_id))
    return _fill_placements(list(profile.placements), array, count)


@_export("nvmlGpuInstanceCreateComputeInstance")
def _create_ci(lib: SimulatedNvmlLibrary, handle: Any, profile_id: Any, out: Any) -> None:
    index, gi = lib.gpu_instance(handle)
    ci = lib.driver.create_compute_instance(index, gi, _value(profile_id))
    _write_address(ctypes.addressof(_target(out)), lib.ci_handle(index, gi, ci))


@_export("nvmlGpuInstanceCreateComputeInstanceWithPlacement")
def _create_ci_placed(lib: SimulatedNvmlLibrary, handle: Any, profile_id: Any, placement: Any, out: Any) -> None:
    index, gi = lib.gpu_instance(handle)
    where = _struct_in(placement)
    ci = lib.driver.create_compute_instance(index, gi, _value(profile_id), (where.start, where.size))
    _write_address(ctypes.addressof(_target(out)), lib.ci_handle(index, gi, ci))


@_export("nvmlGpuInstanceGetComputeInstances")
def _compute_instances(lib: SimulatedNvmlLibrary, handle: Any, profile_id: Any, array: Any, count: Any) -> Return:
    index, gi = lib.gpu_instance(handle)
    cis = lib.driver.compute_instances(index, gi, _value(profile_id))
    return _fill_handles([lib.ci_handle(index, gi, ci) for ci in cis], array, count)


@_export("nvmlGpuInstanceGetComputeInstanceById")
def _compute_instance_by_id(lib: SimulatedNvmlLibrary, handle: Any, ci_id: Any, out: Any) -> None:
    index, gi = lib.gpu_instance(handle)
    ci = lib.driver.compute_instance_by_id(index, gi, _value(ci_id))
    _write_address(ctypes.addressof(_target(out)), lib.ci_handle(index, gi, ci))


@_export("nvmlComputeInstanceGetInfo_v2")
def _ci_info(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    index, gi, ci = lib.compute_instance(handle)
    info = _target(out)
    _write_pointer_field(info, "device", lib.gpu_handle(index))
    _write_pointer_field(info, "gpuInstance", lib.gi_handle(index, gi))
    info.id = ci.id
    info.profileId = ci.profile.id
    info.placement.start, info.placement.size = ci.placement


@_export("nvmlComputeInstanceDestroy")
def _destroy_ci(lib: SimulatedNvmlLibrary, handle: Any) -> None:
    index, gi, ci = lib.compute_instance(handle)
    lib.driver.destroy_compute_instance(index, gi, ci)


# ----- events ---------------------------------------------------------------------------------------


@_export("nvmlEventSetCreate")
def _event_set_create(lib: SimulatedNvmlLibrary, out: Any) -> None:
    event_set = lib.driver.create_event_set()
    handle = lib._handles.address(("es", event_set), ("es", event_set))
    _write_address(ctypes.addressof(_target(out)), handle)


@_export("nvmlEventSetFree")
def _event_set_free(lib: SimulatedNvmlLibrary, handle: Any) -> None:
    lib.driver.free_event_set(lib.event_set(handle))


@_export("nvmlDeviceGetSupportedEventTypes")
def _supported_events(lib: SimulatedNvmlLibrary, handle: Any, out: Any) -> None:
    _set(out, lib.driver.supported_events(lib.gpu_index(handle)))


@_export("nvmlDeviceRegisterEvents")
def _register_events(lib: SimulatedNvmlLibrary, handle: Any, mask: Any, event_set: Any) -> None:
    lib.driver.register_events(lib.event_set(event_set), lib.gpu_index(handle), _value(mask))


@_export("nvmlEventSetWait_v2")
def _event_wait(lib: SimulatedNvmlLibrary, handle: Any, out: Any, timeout_ms: Any) -> None:
    event = lib.driver.wait_event(lib.event_set(handle), _value(timeout_ms))
    data = _target(out)
    _write_pointer_field(data, "device", lib.gpu_handle(event.gpu_index))
    data.eventType = event.event_type
    data.eventData = event.data
    data.gpuInstanceId = event.gi_id
    data.computeInstanceId = event.ci_id


# ----- topology -------------------------------------------------------------------------------------


@_export("nvmlDeviceGetTopologyCommonAncestor")
def _common_ancestor(lib: SimulatedNvmlLibrary, first: Any, second: Any, out: Any) -> None:
    a = lib.driver.gpus[lib.gpu_index(first)]
    b = lib.driver.gpus[lib.gpu_index(second)]
    if a.index == b.index:
        level = TOPOLOGY_INTERNAL
    elif a.pcie_switch == b.pcie_switch:
        level = TOPOLOGY_SINGLE
    elif a.numa_node == b.numa_node:
        level = TOPOLOGY_NODE
    else:
        level = TOPOLOGY_SYSTEM
    _set(out, level)


@_export("nvmlDeviceGetP2PStatus")
def _p2p_status(lib: SimulatedNvmlLibrary, first: Any, second: Any, caps_index: Any, out: Any) -> None:
    a = lib.driver.gpus[lib.gpu_index(first)]
    b_index = lib.gpu_index(second)
    if _value(caps_index) == P2P_CAPS_INDEX_NVLINK:
        _set(out, P2P_STATUS_OK if b_index in a.nvlink_peers else P2P_STATUS_NOT_SUPPORTED)
    else:
        _set(out, P2P_STATUS_OK)


def _link(lib: SimulatedNvmlLibrary, handle: Any, link: Any) -> tuple[Any, int]:
    gpu = lib.driver.gpus[lib.gpu_index(handle)]
    number = _value(link)
    if gpu.model.nvlink_links == 0:
        raise NvmlFault(Return.ERROR_NOT_SUPPORTED, f"{gpu.model.nvml_name} has no NVLink")
    if not 0 <= number < min(gpu.model.nvlink_links, NVLINK_MAX_LINKS):
        raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"link {number} out of range")
    return gpu, number


@_export("nvmlDeviceGetNvLinkState")
def _nvlink_state(lib: SimulatedNvmlLibrary, handle: Any, link: Any, out: Any) -> None:
    gpu, number = _link(lib, handle, link)
    _set(out, int(_link_peer(lib, gpu, number) is not None))


@_export("nvmlDeviceGetNvLinkRemotePciInfo_v2")
def _nvlink_remote(lib: SimulatedNvmlLibrary, handle: Any, link: Any, out: Any) -> None:
    gpu, number = _link(lib, handle, link)
    peer = _link_peer(lib, gpu, number)
    if peer is None:
        raise NvmlFault(Return.ERROR_NOT_SUPPORTED, f"link {number} is down")
    if gpu.nvswitch:  # an NVSwitch: six switches, links spread round-robin over them
        _fill_pci(_target(out), f"00000000:{0xC4 + number % 6:02x}:00.0", 0x1AF110DE)
    else:
        other = lib.driver.gpus[peer]
        _fill_pci(_target(out), other.pci_bus_id, other.model.pci_device_id)


def _link_peer(lib: SimulatedNvmlLibrary, gpu: Any, link: int) -> int | None:
    """The GPU (or, behind NVSwitches, any peer) that a link leads to; None for an unused link."""
    peers = sorted(gpu.nvlink_peers)
    if not peers:
        return None
    if gpu.nvswitch:
        return peers[0]
    return peers[link] if link < len(peers) else None
