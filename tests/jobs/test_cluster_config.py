"""cluster.yaml is a real Ray cluster-launcher config: it validates against the schema Ray ships."""
import json
import os

import yaml


def test_cluster_yaml_validates_against_rays_schema():
    import jsonschema
    import ray

    schema_path = os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")
    with open(schema_path) as f:
        schema = json.load(f)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(here, "cluster.yaml")) as f:
        cfg = yaml.safe_load(f)
    jsonschema.validate(cfg, schema)
    workers = {k: v for k, v in cfg["available_node_types"].items() if k != cfg["head_node_type"]}
    assert any(v["max_workers"] > v.get("min_workers", 0) for v in workers.values())  # autoscales
    for node in cfg["available_node_types"].values():
        assert "IamInstanceProfile" in node["node_config"]  # S3 through the instance profile
    assert any("pip install" in c and "-e ." in c for c in cfg["setup_commands"])
