"""Same inputs and options -> the same accepted set, bit-identical PNGs and identical tables, on
1 CPU and on 2 (FLANN's randomised kd-trees and RANSAC are seeded; nothing depends on task order).

One run uses the session's Ray (2 CPUs, in this process); the other is the job's command line in a
fresh process with ``--num-cpus 1`` (its own local Ray), started first and running at the same time
(its start-up overlaps the first run's work; the two runs' task timings differ all the more).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from jobs.build_pairs import PairsJobConfig, run
from operators.io.storage import Store
from operators.pairs.selection.pairing import PairingConfig
from operators.pairs.registration.registration import RegistrationConfig
from tests.conftest import DATA, REPO

# Wall/CPU times and the run id differ between runs by nature; everything else must not.
RUN_COLUMNS = {"seconds", "cpu_seconds", "run_id"}
ARGS = dict(slice_size=512, stride=256)


def table(out, name):
    rows = pq.read_table(str(out / name)).to_pylist()
    return sorted(({k: v for k, v in r.items() if k not in RUN_COLUMNS} for r in rows),
                  key=lambda r: r["slice_id"])


@pytest.mark.slow
def test_same_output_on_one_and_two_cpus(ray_session, tmp_path):
    archive = tmp_path / "archive"
    archive.mkdir()
    for name in ("m_4709963_se_14_1_20160816.tif", "m_4709963_se_14_1_20200831.tif"):
        shutil.copy(DATA / "naip" / name, archive / name)
    two, one = tmp_path / "two", tmp_path / "one"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen([sys.executable, "-m", "jobs.build_pairs", "--input", str(archive),
                             "--output", str(one), "--slice-size", "512", "--stride", "256",
                             "--crop-size", "256", "--reference-date", "2021-01-01", "--num-cpus", "1"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    try:
        run(PairsJobConfig(input=str(archive), output=str(two), **ARGS),
            PairingConfig(reference_date="2021-01-01"), RegistrationConfig(crop_size=256))
        assert proc.wait(timeout=600) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    meta_two, meta_one = table(two, "metadata"), table(one, "metadata")
    assert len(meta_two) == 6 and meta_one == meta_two
    accepted = [m["slice_id"] for m in meta_two if m["status"] == "accepted"]
    assert accepted
    for sid in accepted:
        for folder in ("A", "B"):
            rel = f"{folder}/{sid}.png"
            assert Store(str(one)).read_bytes(rel) == Store(str(two)).read_bytes(rel), rel
