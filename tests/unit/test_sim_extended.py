"""The special claim of KEP-5004, as the simulated scheduler builds it (``agent.sim.scheduler.extended``)."""

from __future__ import annotations

from agent.sim.scheduler.extended import ANNOTATION, extended_resource_claim, extended_resource_classes


def device_class(name: str, created: str, resource: str | None = None) -> dict:
    spec = {"extendedResourceName": resource} if resource else {}
    return {"metadata": {"name": name, "creationTimestamp": created}, "spec": spec}


def test_the_later_class_wins_a_name_and_of_two_at_once_the_first_name():
    classes = {
        "old": device_class("old", "2026-11-01T00:00:00Z", "nvidia.com/gpu"),
        "new-b": device_class("new-b", "2026-11-02T00:00:00Z", "nvidia.com/gpu"),
        "new-a": device_class("new-a", "2026-11-02T00:00:00Z", "nvidia.com/gpu"),
        "plain": device_class("plain", "2026-11-03T00:00:00Z"),
    }
    served = extended_resource_classes(classes)
    assert served["nvidia.com/gpu"] == "new-a"
    assert served["deviceclass.resource.kubernetes.io/plain"] == "plain"  # every class has its implicit name


def test_one_request_per_container_and_resource_in_sorted_order():
    classes = {
        "gpu.nvidia.com": device_class("gpu.nvidia.com", "2026-11-01T00:00:00Z", "nvidia.com/gpu"),
        "mig.nvidia.com": device_class("mig.nvidia.com", "2026-11-01T00:00:00Z"),
    }
    pod = {
        "metadata": {"name": "p", "namespace": "ml", "uid": "u"},
        "spec": {
            "containers": [
                {"name": "a", "resources": {"limits": {"cpu": "1"}}},
                {"name": "b", "resources": {"limits": {"nvidia.com/gpu": "2",
                                                       "deviceclass.resource.kubernetes.io/mig.nvidia.com": "1"}}},
            ]
        },
    }  # fmt: skip
    built = extended_resource_claim(pod, classes)
    assert built is not None
    claim, mappings = built
    requests = claim["spec"]["devices"]["requests"]
    assert [(r["name"], r["exactly"]["deviceClassName"], r["exactly"]["count"]) for r in requests] == [
        ("container-1-request-0", "mig.nvidia.com", 1),  # "deviceclass.…" sorts before "nvidia.com/gpu"
        ("container-1-request-1", "gpu.nvidia.com", 2),
    ]
    assert [m["containerName"] for m in mappings] == ["b", "b"]
    assert claim["metadata"]["generateName"] == "p-extended-resources-"
    assert claim["metadata"]["annotations"] == {ANNOTATION: "true"}
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "u"


def test_a_pod_without_such_resources_gets_no_claim():
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "a", "resources": {"limits": {"cpu": "1"}}}]}}
    assert extended_resource_claim(pod, {}) is None
