"""The Kubernetes manifests of docs/deploy/k8s: valid YAML, consistent with each other and with
the profile they ship (which must load), and wired as docs/deployment.md says."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from profiles import load_profile

K8S = Path(__file__).resolve().parents[2] / "docs" / "deploy" / "k8s"


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    """Every document of every manifest file, keyed by `Kind/name`."""
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out[f"{doc['kind']}/{doc.get('metadata', {}).get('name', '')}"] = doc
    return out


@pytest.fixture(scope="module")
def profile(docs, tmp_path_factory):
    text = docs["ConfigMap/mossvox-profile"]["data"]["profile.yaml"]
    path = tmp_path_factory.mktemp("profile") / "profile.yaml"
    path.write_text(text)
    return load_profile(str(path))


def container(docs) -> dict:
    (one,) = docs["Deployment/mossvox"]["spec"]["template"]["spec"]["containers"]
    return one


def test_kustomization_lists_every_manifest(docs) -> None:
    listed = docs["Kustomization/"]["resources"]
    files = [p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"]
    assert sorted(listed) == sorted(files)


def test_shipped_profile_loads_and_fits_the_pod(docs, profile) -> None:
    c = container(docs)
    gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert profile.engine.replicas * profile.talker.tensor_parallel == gpus
    assert profile.engine.shutdown == "drain" and profile.api.host == "0.0.0.0"
    assert c["ports"][0]["containerPort"] == profile.api.port
    assert c["command"][:4] == ["mossvox", "serve", "--profile", "/etc/mossvox/profile.yaml"]


def test_probes_and_graceful_drain(docs, profile) -> None:
    c = container(docs)
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["startupProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= profile.engine.ready_timeout_s
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = docs["Deployment/mossvox"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop + profile.engine.drain_timeout_s


def test_data_dir_and_compile_caches_are_shared_storage_and_shm_is_memory(docs, profile) -> None:
    c = container(docs)
    spec = docs["Deployment/mossvox"]["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    data = volumes[mounts[profile.api.data_dir]]["persistentVolumeClaim"]["claimName"]
    assert docs[f"PersistentVolumeClaim/{data}"]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert profile.model.path.startswith(next(p for p, n in mounts.items() if n == "models"))
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    # the compile caches outlive the pod: a pod started later skips the compiles others made
    assert profile.engine.compile_cache_dir.startswith(f"{profile.api.data_dir}/")


def test_service_and_ingress_reach_the_pods(docs) -> None:
    labels = docs["Deployment/mossvox"]["spec"]["template"]["metadata"]["labels"]
    service = docs["Service/mossvox"]["spec"]
    assert service["selector"].items() <= labels.items() and "sessionAffinity" not in service
    backend = docs["Ingress/mossvox"]["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == "mossvox" and backend["port"]["name"] == service["ports"][0]["name"]
    assert docs["Ingress/mossvox"]["metadata"]["annotations"][
        "nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
