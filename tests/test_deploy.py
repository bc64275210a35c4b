"""The Kubernetes manifests in deploy/k8s parse, and what they pass to `hybridkv serve` are
flags it accepts (parsed by the real CLI parser)."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

K8S = Path(__file__).parent.parent / "deploy" / "k8s"


def containers() -> list[dict[str, object]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], path
            if doc["kind"] == "Deployment":
                out += doc["spec"]["template"]["spec"]["containers"]
    return out


def test_the_manifests_parse_and_serve_accepts_their_flags() -> None:
    from hybridkv.cli import build_parser

    serve = [c for c in containers() if c.get("command") == ["hybridkv", "serve"]]
    assert serve, "a hybridkv Deployment"
    for container in serve:
        args = build_parser().parse_args(["serve", *container["args"]])  # type: ignore[misc]
        assert args.kv_remote and args.kv_events_endpoint == "tcp://*:5557"
    kinds = {yaml.safe_load_all(p.read_text()).__next__()["kind"] for p in K8S.glob("*.yaml")}
    assert kinds == {"Deployment"}


def test_the_router_accepts_its_flags() -> None:
    launch = pytest.importorskip("smg.launch_router")
    [router] = [c for c in containers() if c.get("command") == ["smg", "launch"]]
    # Kubernetes fills $(POD_NAMESPACE) in from the container's env.
    argv = [str(a).replace("$(POD_NAMESPACE)", "default") for a in router["args"]]  # type: ignore[attr-defined]
    args = launch.parse_router_args(argv)  # smg's own parser: an unknown flag exits
    assert args.policy == "cache_aware" and args.service_discovery
    assert args.selector == {"app": "hybridkv"}  # the replicas' pod label
    assert args.service_discovery_port == 8000 and args.service_discovery_namespace == "default"
