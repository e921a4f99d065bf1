"""The simulated node's spec reader: strict, every problem named by its path, all of them in one error."""

from __future__ import annotations

import pytest

from agent.sim.nvml.spec import GpuGroupSpec, SimSpecError, build_driver, parse_node_spec


def problems(data: object) -> str:
    with pytest.raises(SimSpecError) as raised:
        parse_node_spec(data, "node.yaml")
    message = str(raised.value)
    assert message.startswith("node.yaml: ")
    return message


def test_a_valid_spec_reads_with_its_defaults():
    spec = parse_node_spec({"name": "n1", "nvlink": [[0, 1]], "gpus": [{"model": "NVIDIA A100-SXM4-80GB", "count": 2}]})
    assert spec.name == "n1" and spec.numa_nodes == 1 and spec.driver_version
    assert spec.nvlink == ((0, 1),)
    assert spec.gpus == (GpuGroupSpec(model="A100-SXM4-80GB", count=2),)  # the NVML name resolves to the key
    driver = build_driver(spec)
    assert [gpu.uuid for gpu in driver.gpus] == [gpu.uuid for gpu in build_driver(spec).gpus]  # same spec, same UUIDs


def test_an_empty_document_is_an_empty_node():
    assert parse_node_spec({}).gpus == ()


def test_every_problem_is_named_by_its_path_in_one_error():
    message = problems(
        {
            "colour": "green",
            "numa_nodes": 9,
            "nvlink": "mesh",
            "gpus": [
                {"model": "T4", "count": 0, "compute_mode": "SHARED", "mig_needs_reset": "yes"},
                {"model": "A100-SXM4-80GB", "mig": {"instances": "1g.10gb"}, "mig_pending": "maybe"},
                {"count": 1},
                "A100",
            ],
        }
    )
    for expected in (
        "colour: unknown field",
        "numa_nodes: 9 is out of range 1..8",
        "nvlink: expected none, nvswitch or a list",
        "gpus[0].count: 0 is out of range 1..64",
        "gpus[0].compute_mode: 'SHARED' is not one of DEFAULT, PROHIBITED, EXCLUSIVE_PROCESS",
        "gpus[0].mig_needs_reset: expected true or false",
        "gpus[1].mig.instances: expected a list of profile names",
        "gpus[1].mig_pending: 'maybe' is not one of enabled, disabled",
        "gpus[2].model: missing",
        "gpus[3]: expected a mapping, got str",
    ):
        assert expected in message


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ([], "(top level): expected a mapping, got list"),
        ({"gpus": {"model": "T4"}}, "gpus: expected a list of GPU groups"),
        ({"gpus": [{"model": "B300"}]}, "gpus[0].model: unknown GPU model 'B300'; known models: "),
        ({"gpus": [{"model": "T4", "count": True}]}, "gpus[0].count: expected a whole number, got True"),
        ({"name": ""}, "name: expected a string of 1 to 63 characters"),
        ({"gpus": [{"model": "T4", "count": 40}, {"model": "L4", "count": 40}]}, "80 GPUs in all"),
        ({"nvlink": [[0, "1"]]}, "nvlink: expected none, nvswitch or a list"),
    ],
)
def test_wrong_shapes_are_refused_with_the_fix(data: object, expected: str):
    assert expected in problems(data)


def test_a_layout_that_does_not_fit_names_the_entry():
    spec = parse_node_spec({"gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": ["7g.80gb", "1g.10gb"]}}]})
    with pytest.raises(SimSpecError, match=r"gpus\[0\]\.mig\.instances\[1\]: 1g\.10gb does not fit"):
        build_driver(spec)
