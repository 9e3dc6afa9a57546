"""The KubeRay RayJob manifests, checked structurally.

KubeRay's CRD schema is not installable from the package registries this project can reach (it
ships with the operator's Helm chart), so this is the documented structural check instead: the
fields the ray.io/v1 RayJob CRD requires, with their types; every container gets credentials from
a Kubernetes secret; no secret value anywhere in the file or in runtime_env; and the entrypoint is
a real job whose parser accepts the given options.
"""
from __future__ import annotations

import importlib
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "deploy" / "kuberay").glob("*.yaml"))
SECRET_WORDS = ("KEY", "SECRET", "TOKEN", "PASSWORD")


def containers(spec: dict) -> list[dict]:
    return spec["template"]["spec"]["containers"]


def structural_errors(doc: dict) -> list[str]:
    """What a ray.io/v1 RayJob must have (KubeRay 1.x CRD), as readable errors."""
    errs = []
    if doc.get("apiVersion") != "ray.io/v1":
        errs.append("apiVersion must be ray.io/v1")
    if doc.get("kind") != "RayJob":
        errs.append("kind must be RayJob")
    if not isinstance(doc.get("metadata", {}).get("name"), str):
        errs.append("metadata.name missing")
    spec = doc.get("spec") or {}
    if not isinstance(spec.get("entrypoint"), str):
        errs.append("spec.entrypoint must be a string")
    if "runtimeEnvYAML" in spec and not isinstance(spec["runtimeEnvYAML"], str):
        errs.append("spec.runtimeEnvYAML must be a YAML string")
    for key in ("shutdownAfterJobFinishes",):
        if key in spec and not isinstance(spec[key], bool):
            errs.append(f"spec.{key} must be a boolean")
    for key in ("ttlSecondsAfterFinished", "backoffLimit"):
        if key in spec and not isinstance(spec[key], int):
            errs.append(f"spec.{key} must be an integer")
    cluster = spec.get("rayClusterSpec") or {}
    head = cluster.get("headGroupSpec")
    if not head:
        return errs + ["spec.rayClusterSpec.headGroupSpec missing"]
    groups = [("head", head)] + [(g.get("groupName"), g) for g in cluster.get("workerGroupSpecs", [])]
    for name, group in groups:
        if not isinstance(group.get("rayStartParams", {}), dict) or any(
                not isinstance(v, str) for v in group.get("rayStartParams", {}).values()):
            errs.append(f"{name}: rayStartParams must map to strings")
        try:
            cs = containers(group)
        except (KeyError, TypeError):
            errs.append(f"{name}: template.spec.containers missing")
            continue
        for c in cs:
            if not c.get("image") or not c.get("name"):
                errs.append(f"{name}: container needs name and image")
    for g in cluster.get("workerGroupSpecs", []):
        if not isinstance(g.get("groupName"), str):
            errs.append("workerGroupSpecs[].groupName missing")
        lo, n, hi = g.get("minReplicas", 0), g.get("replicas", 0), g.get("maxReplicas", 0)
        if not (isinstance(lo, int) and isinstance(hi, int) and lo <= n <= hi):
            errs.append(f"{g.get('groupName')}: need minReplicas <= replicas <= maxReplicas")
    return errs


def secret_leaks(doc: dict) -> list[str]:
    """Literal values under secret-looking names, in container env or runtime_env."""
    leaks = []
    spec = doc["spec"]
    runtime_env = yaml.safe_load(spec.get("runtimeEnvYAML") or "{}") or {}
    for k in (runtime_env.get("env_vars") or {}):
        if any(w in k.upper() for w in SECRET_WORDS):
            leaks.append(f"runtime_env.env_vars.{k}")
    cluster = spec["rayClusterSpec"]
    for group in [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]:
        for c in containers(group):
            for e in c.get("env", []):
                if any(w in e["name"].upper() for w in SECRET_WORDS) and "value" in e:
                    leaks.append(f"{c['name']}.env.{e['name']}")
            if not any("secretRef" in src for src in c.get("envFrom", [])):
                leaks.append(f"{c['name']}: no envFrom secretRef (where do credentials come from?)")
    return leaks


def test_there_are_manifests():
    assert {p.name for p in MANIFESTS} >= {"rayjob-pairs.yaml", "rayjob-captions.yaml"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_a_valid_rayjob_with_secrets_from_kubernetes(path):
    doc = yaml.safe_load(path.read_text())
    assert structural_errors(doc) == []
    assert secret_leaks(doc) == []


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_entrypoint_is_a_job_that_accepts_its_options(path):
    argv = shlex.split(yaml.safe_load(path.read_text())["spec"]["entrypoint"])
    assert argv[:2] == ["python", "-m"] and argv[2].startswith("jobs.")
    job = importlib.import_module(argv[2])
    # Every job builds its parser with build_parser: SystemExit on an unknown or malformed option.
    job.build_parser().parse_args(argv[3:])


def test_structural_check_catches_what_it_claims():
    """The checker itself: a broken manifest is reported, item by item."""
    doc = yaml.safe_load(MANIFESTS[0].read_text())
    doc["kind"] = "RayCluster"
    doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["minReplicas"] = 99
    doc["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    errs = structural_errors(doc)
    assert any("kind" in e for e in errs) and any("minReplicas" in e for e in errs)
    assert any("rayStartParams" in e for e in errs)
    doc = yaml.safe_load(MANIFESTS[0].read_text())
    doc["spec"]["runtimeEnvYAML"] = "env_vars:\n  OPENAI_API_KEY: sk-live\n"
    head = doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["env"] = [{"name": "AWS_SECRET_ACCESS_KEY", "value": "abc"}]
    assert len(secret_leaks(doc)) == 2
