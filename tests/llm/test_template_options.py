"""A mistyped prompt template fails at the command line, before any work, with one line naming the
option and the value (and the versions of that template there are)."""
import json

import pytest

from jobs import caption, qa

BASE = ["--input", "data/levir-cd", "--output", "unused-out", "--model", "m", "--base-url", "http://127.0.0.1:9/v1"]

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("job, flag, value, known", [
    (caption, "--judge-template", "caption_judge.v7", "caption_judge.v4"),
    (qa, "--generate-template", "qa_generate.v0", "qa_generate.v4"),
])
def test_an_unknown_template_is_one_line_naming_the_option(job, flag, value, known, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        job.parse_args(BASE + [flag, value])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"{flag}: '{value}': no such template in" in err and known in err


def test_a_template_in_the_given_prompts_dir_is_found_and_one_outside_it_is_not(capsys, tmp_path):
    (tmp_path / "mine.v1.txt").write_text("## system\nS\n## user\nU\n")
    cfg = caption.parse_args(BASE + ["--prompts-dir", str(tmp_path), "--judge-template", "mine.v1",
                                     "--generate-template", "mine.v1"])
    assert cfg.judge_template == "mine.v1"
    with pytest.raises(SystemExit):
        caption.parse_args(BASE + ["--prompts-dir", str(tmp_path)])   # the default templates are not there
    assert "--generate-template: 'caption_generate.v4': no such template in" in capsys.readouterr().err


def test_a_chosen_template_wins_over_the_ones_an_output_records_and_is_recorded(tmp_path):
    """Left at the defaults, a run on an existing output goes on with the templates it records
    (prompts.json); a choice of the user's is used as given, recorded for the next run (the other job's
    entry untouched), and the next run at the defaults goes on with it. (The captions job's upgrade rerun,
    tests/jobs/test_caption_job.py, runs the first case and a chosen template on a new output through the
    job.)"""
    from operators.io.storage import Store
    from operators.llm.job_runner import PROMPTS_FILE, output_templates
    out = Store(str(tmp_path))
    qa_entry = {"generate": "qa_generate.v3", "judge": "qa_judge.v3"}
    out.write_bytes(PROMPTS_FILE, json.dumps({"caption": {"generate": "caption_generate.v2",
                                                          "judge": "caption_judge.v2"}, "qa": qa_entry}).encode())
    defaults = ("caption_generate.v4", "caption_judge.v4")
    assert output_templates(out, "caption", defaults, defaults) == ("caption_generate.v2", "caption_judge.v2")
    chosen = ("caption_generate.v1", "caption_judge.v4")
    assert output_templates(out, "caption", chosen, defaults) == chosen
    recorded = json.loads(out.read_bytes(PROMPTS_FILE))
    assert recorded == {"caption": {"generate": "caption_generate.v1", "judge": "caption_judge.v4"}, "qa": qa_entry}
    assert output_templates(out, "caption", defaults, defaults) == chosen
