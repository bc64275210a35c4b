"""The client examples of docs/serving.md, one per API, run as written against a live server
(its address put in place of localhost:8000)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import LiveServer, live_server

DOC = Path(__file__).parents[2] / "docs" / "serving.md"
SECTIONS = {"Anthropic Messages API": "anthropic", "Ollama API": "ollama",
            "OpenAI Responses API": "openai"}


def example(section: str) -> str:
    """The first python block of the section."""
    text = DOC.read_text(encoding="utf-8")
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", body, re.DOTALL)
    assert found, f"docs/serving.md: no python example under '## {section}'"
    return found.group(1)


@pytest.fixture(scope="module")
def server(demo_dir: Path) -> Iterator[LiveServer]:
    with live_server(demo_dir, name="tiny") as live:
        yield live


@pytest.mark.parametrize("section", list(SECTIONS))
def test_the_example_runs(server: LiveServer, section: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip(SECTIONS[section])
    code = example(section)
    assert "http://localhost:8000" in code
    exec(compile(code.replace("http://localhost:8000", server.url), str(DOC), "exec"), {})
    assert capsys.readouterr().out.strip()
