"""The captions job's --batch-api against a Batch API that behaves as providers do (Ray Data + the test
server): creation replies lost, an enqueued-token limit, per-minute 429s in OpenAI's own words on /files
and /batches: every pair finished, each line paid once, exit 0; a per-day (TPD) limit: exit 3 at once,
nothing submitted."""
import pytest

from jobs.caption import main
from tests.jobs.test_caption_job import ALL_PAIRS, accounted, tables
from tests.jobs.test_llm_money_jobs import argv
from tests.llm.test_llm_errors import PROVIDERS

pytestmark = pytest.mark.slow

BODY = {name: body for name, _, body, _, _ in PROVIDERS}
LIMIT = 12_000    # tokens in open batches per model: a few lines a wave


@pytest.mark.timeout(900)
def test_a_provider_like_batch_api_finishes_every_pair_and_pays_each_line_once(
        ray_session, openai_server, llm_namespace, tmp_path, capsys):
    openai_server.configure(batch_create_lost=2, batch_enqueued_limit=LIMIT, batch_delay_s=0.2,
                            error_reply={"status": 429, "body": BODY["openai TPM"], "headers": {"retry-after-ms": "50"},
                                         "times": 3, "paths": ["files", "batches"]})
    out = tmp_path / "out"
    code = main([*argv(openai_server, out, batch_poll_s=0.1, batch_max_enqueued_tokens=LIMIT,
                       image_token_rule="tile:85:170"), "--batch-api"])
    printed = capsys.readouterr().out
    assert code == 0, printed[-2000:]
    stats = openai_server.stats()
    t = tables(out)
    assert accounted(t) == ALL_PAIRS and {e["error_type"] for e in t["errors"]} <= {"NoMask"}
    assert stats["total"] == 0                                                        # nothing in real time
    assert stats["creates_lost"] == 2 and stats["batches_refused"] == 0 and stats["enqueued_peak"] <= LIMIT
    assert sum(stats["error_replies"].values()) == 3
    assert len(stats["batch_submissions"]) == 2 * len(t["pairs"]) and set(stats["batch_submissions"].values()) == {1}
    assert stats["batches_created"] > 4                                               # in waves


@pytest.mark.timeout(600)
def test_a_per_day_limit_at_the_batch_api_stops_the_job_with_exit_3(ray_session, openai_server, llm_namespace,
                                                                      tmp_path, capsys):
    openai_server.configure(error_reply={"status": 429, "body": BODY["openai TPD"], "times": 1, "paths": ["files"]})
    code = main([*argv(openai_server, tmp_path / "out", batch_poll_s=0.1), "--batch-api"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 3 and "quota" in last and "per day" in last
    assert openai_server.stats()["batch_submissions"] == {}
