"""The captions job (``python -m jobs.caption --batch-api``, its Ray and all) SIGKILLed at the step a lost
answer costs most: its second batch created at the provider, the answer never reaching the driver, so
its id is written nowhere; then run again to the end. Each line is submitted once, every pair is
finished, and the batch the killed driver never heard of is found at the provider, not made again.

The test knows where the driver is from the wire (tests/llm/test_llm_batch_kill.py's gate holds that
``POST /v1/batches`` after the server answered it), not from a sleep. The steps before it, and the
kill while polling, are killed in the driver alone (tests/llm/test_llm_batch_kill.py); the rerun here
polls the batch the killed driver left open, as after a kill while polling."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import types

import pytest

from jobs.caption import run
from tests.jobs.test_caption_job import ALL_PAIRS, LEVIR, REPO, accounted, config, tables
from tests.jobs.test_llm_money_jobs import argv
from tests.llm.test_llm_batch_kill import STEPS, Gate, wait_held

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)   # two runs of the job, the first in a process (and a Ray) of its own
def test_the_job_sigkilled_after_a_creation_it_never_heard_of_pays_each_line_once(ray_session, openai_server,
                                                                                  tmp_path):
    out = tmp_path / "out"
    gate = Gate(openai_server.base_url, *STEPS["after create"], at=2)
    endpoint = types.SimpleNamespace(base_url=gate.base_url)   # both runs: one endpoint (a request's key names it)
    ray_tmp = tempfile.mkdtemp(prefix="rk", dir="/tmp")         # short: Ray's socket paths are bounded
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(OPENAI_API_KEY="sk-test", RAY_TMPDIR=ray_tmp, PYTHONPATH=str(REPO))
    log_path = tmp_path / "job.log"
    cmd = [sys.executable, "-m", "jobs.caption", *argv(endpoint, out), "--batch-api", "--batch-poll-s", "0.2",
           "--batch-max-requests", "4", "--num-cpus", "2"]
    try:
        with open(log_path, "wb") as log:   # a session of its own: the Ray it starts ends with it
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)
        try:
            wait_held(gate, proc, log_path, timeout_s=600)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            shutil.rmtree(ray_tmp, ignore_errors=True)
        assert proc.returncode == -signal.SIGKILL
        killed = openai_server.stats()
        assert killed["batches_created"] == 2 and set(killed["batch_submissions"].values()) == {1}
        recorded = list((out / "_batch" / "caption" / "batches").glob("*.json"))
        assert len(recorded) == 1                                  # the second batch's id was never written

        gate.open()
        summary = run(config(endpoint, LEVIR, out, batch_api=True, batch_poll_s=0.1, batch_max_requests=4))
    finally:
        gate.close()
    stats = openai_server.stats()
    t = tables(out)
    assert summary["stopped"] == "" and accounted(t) == ALL_PAIRS
    assert stats["total"] == 0                                     # nothing in real time
    assert len(stats["batch_submissions"]) == 2 * len(t["pairs"]) and set(stats["batch_submissions"].values()) == {1}
    assert len(t["usage"]) == 2 * len(t["pairs"]) and all(u["batch_id"] for u in t["usage"])
