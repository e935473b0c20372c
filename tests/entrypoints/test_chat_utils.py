"""``--chat-template``: a file or the template text; a path that does not exist is an error
(vLLM's rule), never a template that prints the path."""

from __future__ import annotations

import pytest

from qwenserve.entrypoints.chat_utils import load_chat_template
from qwenserve.entrypoints.openai.api_server import main


def test_a_file_is_read_and_text_is_kept(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    assert load_chat_template(None) is None


@pytest.mark.parametrize("value", ["templates/qwen3", "/no/such/chat.jinja2", "chat_template.j"])
def test_a_missing_path_is_an_error(value):
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(value)


@pytest.mark.timeout(120)  # before the fix the path became the template and the server ran
def test_the_server_refuses_to_start_with_a_missing_template(caplog):
    argv = ["--host", "127.0.0.1", "--port", "0", "--chat-template", "templates/missing"]
    assert main(argv) == 1
    assert "--chat-template templates/missing: no such file" in caplog.text
