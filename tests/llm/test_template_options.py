"""A mistyped prompt template fails at the command line, before any work, with one line naming the
option and the value (and the versions of that template there are)."""
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
