"""--prompts: a file of named templates replaces ours, and must keep exactly our placeholders."""
import json

import pytest

import common

DEFAULTS = {"solve": "Question: {question}\nAnswer in \\boxed{{}}.", "propose": "Read {document} and ask."}


def test_no_file_gives_our_templates():
    assert common.load_prompts("", DEFAULTS) == DEFAULTS


def test_toml_and_json_replace_named_templates(tmp_path):
    toml = tmp_path / "p.toml"
    toml.write_text("solve = '''Q: {question}\nPut it in \\boxed{{}}.'''\n")
    got = common.load_prompts(str(toml), DEFAULTS)
    assert got["solve"] == "Q: {question}\nPut it in \\boxed{{}}."
    assert got["propose"] == DEFAULTS["propose"]
    assert got["solve"].format(question="1+1?") == "Q: 1+1?\nPut it in \\boxed{}."
    js = tmp_path / "p.json"
    js.write_text(json.dumps({"propose": "Doc: {document}. Write a question."}))
    assert common.load_prompts(str(js), DEFAULTS)["propose"].startswith("Doc: {document}")


@pytest.mark.parametrize("text, match", [
    ("Q only", r"exactly the placeholders \['question'\]; missing \['question'\]"),
    ("{question} {answer}", r"unknown \['answer'\]"),
    ("{question.__class__}", "plain name"),
    ("{question!r}", "plain name"),
    ("", "non-empty"),
])
def test_wrong_placeholders_are_one_line_errors(tmp_path, text, match):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"solve": text}))
    with pytest.raises(ValueError, match=match):
        common.load_prompts(str(f), DEFAULTS)


def test_unknown_name_missing_file_and_bad_syntax(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"sovle": "{question}"}))
    with pytest.raises(ValueError, match=r"unknown template 'sovle'.*\['propose', 'solve'\]"):
        common.load_prompts(str(f), DEFAULTS)
    with pytest.raises(ValueError, match="no such file"):
        common.load_prompts(str(tmp_path / "none.toml"), DEFAULTS)
    bad = tmp_path / "bad.toml"
    bad.write_text("solve = '''unterminated")
    with pytest.raises(ValueError, match="cannot parse"):
        common.load_prompts(str(bad), DEFAULTS)
