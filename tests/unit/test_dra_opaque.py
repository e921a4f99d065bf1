"""NVIDIA's opaque configs (resource.nvidia.com/v1beta1) decode as NVIDIA's DRA driver decodes them: strictly."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from agent.core.dra.opaque import (
    API_VERSION,
    MAX_PARAMETERS_BYTES,
    DeviceConfig,
    MpsConfig,
    OpaqueConfigError,
    Sharing,
    decode,
    parse_quantity,
    pinned_memory_limits,
    unsupported,
)


def gpu_config(**fields: object) -> dict[str, object]:
    return {"apiVersion": API_VERSION, "kind": "GpuConfig", **fields}


def mig_config(**fields: object) -> dict[str, object]:
    return {"apiVersion": API_VERSION, "kind": "MigDeviceConfig", **fields}


def test_a_gpu_config_without_sharing_decodes_from_raw_bytes_and_from_the_claims_json():
    raw = b'{"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}'
    assert decode(raw) == decode(json.loads(raw)) == DeviceConfig(kind="GpuConfig")
    assert decode(mig_config()).device_kind == "mig"
    assert decode(gpu_config(sharing=None)) == DeviceConfig(kind="GpuConfig")  # null means "not set", as in Go


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        pytest.param(
            gpu_config(sharing={"strategy": "TimeSlicing"}),
            Sharing(strategy="TimeSlicing", interval="Default"),
            id="TimeSlicing without timeSlicingConfig is interval Default",
        ),
        pytest.param(
            gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
            Sharing(strategy="TimeSlicing", interval="Long"),
            id="interval Long",
        ),
        pytest.param(
            gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {}}),
            Sharing(strategy="TimeSlicing", interval="Default"),
            id="timeSlicingConfig without interval is Default",
        ),
        pytest.param(
            gpu_config(sharing={"strategy": "MPS"}),
            Sharing(strategy="MPS", mps=MpsConfig()),
            id="MPS without mpsConfig is {}",
        ),
        pytest.param(
            gpu_config(
                sharing={
                    "strategy": "MPS",
                    "mpsConfig": {
                        "defaultActiveThreadPercentage": 50,
                        "defaultPinnedDeviceMemoryLimit": "10Gi",
                        "defaultPerDevicePinnedMemoryLimit": {"0": "1500M", "GPU-b": 2097152},
                    },
                }
            ),
            Sharing(
                strategy="MPS",
                mps=MpsConfig(
                    default_active_thread_percentage=50,
                    default_pinned_device_memory_limit="10240M",
                    default_per_device_pinned_memory_limit={"0": "1430M", "GPU-b": "2M"},
                ),
            ),
            id="MPS limits in NVIDIA's <MiB>M",
        ),
        pytest.param(
            mig_config(sharing={"strategy": "TimeSlicing"}),
            Sharing(strategy="TimeSlicing"),
            id="TimeSlicing on a MIG device has no interval",
        ),
        pytest.param(
            mig_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}),
            Sharing(strategy="MPS", mps=MpsConfig(default_active_thread_percentage=0)),
            id="MPS on a MIG device",
        ),
    ],
)
def test_sharing_is_normalised_like_nvidia(parameters: dict[str, object], expected: Sharing):
    assert decode(parameters).sharing == expected


def test_the_interval_is_the_number_nvidia_smi_takes():
    values = {
        name: decode(gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": name}}))
        for name in ("Default", "Short", "Medium", "Long")
    }
    assert {name: c.sharing.interval_value for name, c in values.items() if c.sharing} == {
        "Default": 0,
        "Short": 1,
        "Medium": 2,
        "Long": 3,
    }


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        pytest.param(gpu_config(sharnig={}), 'unknown field "sharnig" (did you mean "sharing"?)', id="misspelt field"),
        pytest.param(
            gpu_config(sharing={"stratgy": "MPS"}), 'unknown field "sharing.stratgy"', id="misspelt nested field"
        ),
        pytest.param(gpu_config(Sharing={}), 'unknown field "Sharing" (did you mean "sharing"?)', id="wrong case"),
        pytest.param(
            gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"activeThreadPercentage": 5}}),
            'unknown field "sharing.mpsConfig.activeThreadPercentage"',
            id="MPS field without its default prefix",
        ),
        pytest.param(
            mig_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
            'unknown field "sharing.timeSlicingConfig"',
            id="MigDeviceConfig has no timeSlicingConfig",
        ),
        pytest.param(
            gpu_config(metadata={"name": "x"}, extra=1),
            'strict decoding error: unknown field "metadata", unknown field "extra"',
            id="every unknown field is named",
        ),
        pytest.param(
            {"apiVersion": API_VERSION, "kind": "VfioDeviceConfig", "iommu": {"backendPolicy": "LegacyOnly", "x": 1}},
            'strict decoding error: unknown field "iommu.x"',
            id="VfioDeviceConfig is decoded strictly",
        ),
        pytest.param(
            {"apiVersion": API_VERSION, "kind": "VfioDeviceConfig", "iommu": {"enableAPIDevice": "yes"}},
            'iommu.enableAPIDevice: expected true or false, got string "yes"',
            id="VfioDeviceConfig field of the wrong type",
        ),
        pytest.param(
            {"apiVersion": API_VERSION, "kind": "GPUConfig"},
            'unknown kind "GPUConfig" for apiVersion resource.nvidia.com/v1beta1: use GpuConfig or MigDeviceConfig',
            id="unknown kind",
        ),
        pytest.param(
            {"apiVersion": "resource.nvidia.com/v1alpha1", "kind": "GpuConfig"},
            'unknown apiVersion "resource.nvidia.com/v1alpha1" (kind GpuConfig)',
            id="old apiVersion",
        ),
        pytest.param(
            {"apiVersion": "gpu.resource.example.com/v1", "kind": "GpuConfig"},
            'unknown apiVersion "gpu.resource.example.com/v1"',
            id="another group",
        ),
        pytest.param({"apiVersion": API_VERSION}, "kind is missing", id="no kind"),
        pytest.param({"kind": "GpuConfig"}, "apiVersion is missing", id="no apiVersion"),
        pytest.param([gpu_config()], "parameters must be a JSON object", id="not an object"),
        pytest.param(
            gpu_config(sharing={"strategy": "Fabric"}),
            "unknown GPU sharing strategy: Fabric, supported GPU sharing strategies: TimeSlicing, MPS",
            id="unknown strategy",
        ),
        pytest.param(gpu_config(sharing={}), "unknown GPU sharing strategy: (empty)", id="sharing without strategy"),
        pytest.param(
            gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "VeryLong"}}),
            "unknown time-slice interval: VeryLong, supported time-slice intervals: Default, Short, Medium, Long",
            id="unknown interval",
        ),
        pytest.param(
            gpu_config(sharing={"strategy": "TimeSlicing", "mpsConfig": {}}),
            "cannot use MpsConfig with the 'TimeSlicing' strategy",
            id="mpsConfig with TimeSlicing",
        ),
        pytest.param(
            gpu_config(sharing={"strategy": "MPS", "timeSlicingConfig": {"interval": "Short"}}),
            "cannot use TimeSlicingConfig with the 'MPS' strategy",
            id="timeSlicingConfig with MPS",
        ),
        pytest.param(
            gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}}),
            "active thread percentage must not be greater than 100",
            id="percentage over 100",
        ),
        pytest.param(
            gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": -1}}),
            "active thread percentage must not be negative",
            id="negative percentage",
        ),
        pytest.param(
            gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": "50"}}),
            'defaultActiveThreadPercentage: expected an integer, got string "50"',
            id="percentage as a string",
        ),
        pytest.param(
            gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": True}}),
            "expected an integer, got boolean true",
            id="percentage as a boolean",
        ),
        pytest.param(
            gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "512Ki"}}),
            "defaultPinnedDeviceMemoryLimit: invalid limit: 512Ki is below the minimum of 1Mi",
            id="limit under 1 MiB",
        ),
        pytest.param(
            gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "10 GB"}}),
            "defaultPinnedDeviceMemoryLimit: '10 GB' is not a quantity",
            id="limit not a quantity",
        ),
        pytest.param(
            gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"0": "-1Gi"}}}),
            "defaultPerDevicePinnedMemoryLimit[0]: invalid limit: -1Gi is below the minimum of 1Mi",
            id="negative per-device limit",
        ),
        pytest.param(
            gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"multiUser": "yes"}}),
            'multiUser: expected true or false, got string "yes"',
            id="multiUser not a boolean",
        ),
    ],
)
def test_bad_parameters_are_refused_with_the_field_and_the_reason(parameters: object, message: str):
    with pytest.raises(OpaqueConfigError) as refused:
        decode(parameters)  # type: ignore[arg-type]
    assert message in str(refused.value)


def test_a_duplicated_field_is_refused_as_the_strict_decoder_does():
    raw = b'{"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "kind": "MigDeviceConfig"}'
    with pytest.raises(OpaqueConfigError, match='strict decoding error: duplicate field "kind"'):
        decode(raw)


def test_parameters_over_10_kib_are_refused_before_they_are_read():
    padding = "x" * MAX_PARAMETERS_BYTES
    with pytest.raises(OpaqueConfigError, match=r"over the API's limit of 10240 bytes \(10 KiB\)"):
        decode(json.dumps(gpu_config(note=padding)).encode())
    with pytest.raises(OpaqueConfigError, match="10 KiB"):
        decode(gpu_config(note=padding))


def test_invalid_json_is_refused():
    with pytest.raises(OpaqueConfigError, match="not valid JSON"):
        decode(b'{"apiVersion": ')


def test_mps_multi_user_from_nvidias_newer_releases_decodes_and_true_is_what_tessera_cannot_apply():
    config = decode(gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"multiUser": False}}))
    assert config.sharing is not None and config.sharing.mps == MpsConfig(multi_user=False)
    assert unsupported(config) is None
    config = decode(gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"multiUser": True}}))
    assert config.sharing is not None and config.sharing.mps == MpsConfig(multi_user=True)
    assert "multiUser: true is not supported by Tessera" in (unsupported(config) or "")


@pytest.mark.parametrize(
    ("parameters", "device_kind"),
    [
        ({"apiVersion": API_VERSION, "kind": "VfioDeviceConfig"}, "vfio"),
        ({"apiVersion": API_VERSION, "kind": "VfioDeviceConfig", "iommu": {"backendPolicy": "PreferIommuFD"}}, "vfio"),
        ({"apiVersion": API_VERSION, "kind": "ComputeDomainChannelConfig", "domainID": "x"}, "compute-domain"),
        ({"apiVersion": API_VERSION, "kind": "ComputeDomainDaemonConfig", "domainID": "x"}, "compute-domain"),
    ],
)
def test_nvidias_other_kinds_decode_as_configs_for_devices_tessera_does_not_publish(parameters, device_kind):
    config = decode(parameters)
    assert config.kind == parameters["kind"] and config.device_kind == device_kind and config.sharing is None


def test_pinned_memory_limits_resolve_device_indices_and_uuids_like_nvidia():
    mps = MpsConfig(default_pinned_device_memory_limit="1024M", default_per_device_pinned_memory_limit={"1": "2048M"})
    assert pinned_memory_limits(mps, ["GPU-a", "GPU-b", "GPU-c"]) == {
        "GPU-a": "1024M",
        "GPU-b": "2048M",
        "GPU-c": "1024M",
    }
    by_uuid = MpsConfig(default_per_device_pinned_memory_limit={"GPU-c": "512M"})
    assert pinned_memory_limits(by_uuid, ["GPU-a", "GPU-c"]) == {"GPU-c": "512M"}
    with pytest.raises(OpaqueConfigError, match="invalid device index 2: the config applies to 2 device"):
        pinned_memory_limits(MpsConfig(default_per_device_pinned_memory_limit={"2": "1M"}), ["GPU-a", "GPU-c"])
    with pytest.raises(OpaqueConfigError, match="'GPU-z' is neither an index nor the UUID"):
        pinned_memory_limits(MpsConfig(default_per_device_pinned_memory_limit={"GPU-z": "1M"}), ["GPU-a"])


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1Gi", 1 << 30),
        ("512Mi", 512 << 20),
        ("1.5Gi", 3 << 29),
        ("2G", 2 * 10**9),
        ("1e9", 10**9),
        ("1E3", 1000),  # E with digits is an exponent ...
        ("2E", 2 * 10**18),  # ... E alone is exa
        ("100m", Fraction(1, 10)),
        ("+.5Ki", 512),
        ("1048576", 1 << 20),
        ("-1Mi", -(1 << 20)),
    ],
)
def test_kubernetes_quantities(text: str, value: int | Fraction):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "1 Gi", "1GB", "1e", "0x10", "1.2.3"])
def test_not_quantities(text: str):
    with pytest.raises(ValueError, match="is not a quantity"):
        parse_quantity(text)


# ----- numbers a claim writes: bounded before any arithmetic, always the config's own error ----------------------

HUGE = "1e10000000"
INT64_BOUND = "the most allowed here is 9223372036854775807 (2^63 - 1, the largest int64)"


@pytest.mark.timeout(10)  # the unbounded parser held the GIL 9-34 s on "1e10000000", then raised a bare ValueError
@pytest.mark.parametrize(
    ("mps", "message"),
    [
        pytest.param(
            {"defaultPinnedDeviceMemoryLimit": HUGE},
            f"sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: '{HUGE}' is too large: {INT64_BOUND}",
            id="default limit 1e10000000",
        ),
        pytest.param(
            {"defaultPinnedDeviceMemoryLimit": "1e100000000"},
            f"defaultPinnedDeviceMemoryLimit: '1e100000000' is too large: {INT64_BOUND}",
            id="one more digit",
        ),
        pytest.param(
            {"defaultPerDevicePinnedMemoryLimit": {"0": HUGE}},
            f"sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[0]: '{HUGE}' is too large: {INT64_BOUND}",
            id="per-device limit 1e10000000",
        ),
        pytest.param(
            {"defaultPinnedDeviceMemoryLimit": "-" + HUGE},
            f"defaultPinnedDeviceMemoryLimit: '-{HUGE}' is too small",
            id="negative",
        ),
        pytest.param(
            {"defaultPinnedDeviceMemoryLimit": "9" * 5000},
            f"defaultPinnedDeviceMemoryLimit: '{'9' * 40}'... (5000 characters) is too large: {INT64_BOUND}",
            id="5000 digits",
        ),
        pytest.param(
            {"defaultPinnedDeviceMemoryLimit": 10**30},
            f"defaultPinnedDeviceMemoryLimit: {10**30} is too large: {INT64_BOUND}",
            id="JSON integer 10**30",
        ),
        pytest.param(
            {"defaultPinnedDeviceMemoryLimit": 1e308},
            f"defaultPinnedDeviceMemoryLimit: '1e+308' is too large: {INT64_BOUND}",
            id="JSON number 1e308",
        ),
        pytest.param(
            {"defaultPinnedDeviceMemoryLimit": "1e-10000000"},
            "defaultPinnedDeviceMemoryLimit: invalid limit: 1e-10000000 is below the minimum of 1Mi",
            id="1e-10000000 is 1n",
        ),
        pytest.param(
            {"defaultActiveThreadPercentage": 10**1000},
            "active thread percentage must not be greater than 100",
            id="percentage 10**1000",
        ),
    ],
)
def test_huge_numbers_are_the_configs_error_naming_the_field_and_the_bound(mps: dict, message: str) -> None:
    for config in (gpu_config, mig_config):
        parameters = config(sharing={"strategy": "MPS", "mpsConfig": mps})
        for sent in (parameters, json.dumps(parameters).encode()):  # parsed from the claim, or raw as sent
            with pytest.raises(OpaqueConfigError) as refused:
                decode(sent)
            assert message in str(refused.value)


def test_a_json_number_too_big_for_a_float_is_no_quantity() -> None:
    raw = json.dumps(gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": 0}}))
    with pytest.raises(OpaqueConfigError, match=r"defaultPinnedDeviceMemoryLimit: inf is not a quantity"):
        decode(raw.replace(": 0}", ": 1e10000000}").encode())  # Python's JSON reads it as inf


def test_a_device_index_thousands_of_digits_long_is_an_invalid_index() -> None:
    key = "9" * 5000  # int() of it raised ValueError: an internal error, retried for ever
    mps = decode(
        gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {key: "1Gi"}}})
    ).sharing.mps  # type: ignore[union-attr]
    with pytest.raises(OpaqueConfigError, match=r"invalid device index '9{40}'\.\.\. \(5000 characters\): the config"):
        pinned_memory_limits(mps, ["GPU-a"])  # type: ignore[arg-type]


def test_whatever_fails_inside_decoding_is_the_configs_error_never_an_internal_one() -> None:
    nested: dict[str, object] = {}
    inner = nested
    for _ in range(100_000):  # deeper than Python's recursion limit: json.dumps raises RecursionError
        inner["a"] = inner = {}
    with pytest.raises(OpaqueConfigError, match="parameters cannot be decoded: RecursionError"):
        decode(gpu_config(note=nested))
