"""jobs.validate: a claims JSONL and a LEVIR-CC JSON audited against real masks (local and S3), every
claim ending in verdicts.jsonl and the Parquet table, a missing mask as that claim's error."""
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from jobs.validate import run

REPO = Path(__file__).resolve().parents[2]
LABELS = REPO / "data" / "levir-cd" / "label"


def read_verdicts(out):
    return [json.loads(line) for line in (Path(out) / "verdicts.jsonl").read_text().splitlines()]


def test_claims_jsonl(tmp_path):
    claims = [
        {"id": "empty-but-built", "mask": "train_386_0512_0768.png", "text": "Several new houses were built."},
        {"id": "empty-ok", "mask": "train_386_0512_0768.png", "text": "No change is visible."},
        {"id": "yes-where-empty", "mask": "test_77_0512_0256.png", "text": "Yes, a new house.",
         "question": "Was anything built in the upper-left of the image?", "type": "YES/NO"},
        {"id": "no-mask", "mask": "missing.png", "text": "Anything."},
    ]
    path = tmp_path / "claims.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in claims) + "\n")
    summary = run(str(path), str(tmp_path / "out"), str(LABELS))
    verdicts = {v["id"]: v for v in read_verdicts(tmp_path / "out")}
    assert list(verdicts) == [c["id"] for c in claims]
    assert verdicts["empty-but-built"]["ok"] is False
    assert "change" in {v["rule"] for v in verdicts["empty-but-built"]["violations"]}
    assert verdicts["empty-ok"] == {"id": "empty-ok", "ok": True, "violations": []}
    assert [v["rule"] for v in verdicts["yes-where-empty"]["violations"]] == ["existence"]
    assert verdicts["no-mask"]["ok"] is None and "missing.png" in verdicts["no-mask"]["error"]
    table = pq.read_table(tmp_path / "out" / "verdicts").to_pylist()
    assert sorted(r["id"] for r in table) == sorted(verdicts)
    assert summary["violating"] == 2 and summary["errors"] == 1 and summary["caught"]["existence"] == 1


def test_levir_cc_json_from_s3_via_cli(tmp_path, s3_client, s3_bucket):
    for p in LABELS.glob("*.png"):
        s3_client.upload_file(str(p), s3_bucket, f"levir/test/label/{p.name}")
    doc = {"images": [
        {"filename": "train_386_0512_0768.png", "filepath": "test", "sentences": [
            {"raw": " a new road was built across the scene .", "sentid": 0},
            {"raw": " the scene is unchanged .", "sentid": 1}]},
        {"filename": "test_2_0000_0000.png", "filepath": "test", "sentences": [
            {"raw": " there is no change .", "sentid": 2}]}]}
    (tmp_path / "LevirCCcaptions.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "jobs.validate", "--input", str(tmp_path / "LevirCCcaptions.json"),
                           "--masks", f"s3://{s3_bucket}/levir", "--output", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    verdicts = {v["id"]: v for v in read_verdicts(out)}
    assert {k: v["ok"] for k, v in verdicts.items()} == {"train_386_0512_0768.png#0": False,
                                                         "train_386_0512_0768.png#1": True,
                                                         "test_2_0000_0000.png#2": False}
    assert "change=2" in proc.stdout
