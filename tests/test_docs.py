"""The docs site builds with warnings as errors (`make docs`): every page in the nav, every
link between them, every docstring of the API reference; the README stays short and its
links lead to pages that exist."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "Decorate a single-device step" in api
    assert "Why input" in api  # Plan.explain's docstring, read from the code


def test_the_readme_is_short_and_its_links_resolve():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert text.count("\n") <= 160
    assert text.startswith("# autopar\n\n```bash\nmake run")
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        assert os.path.exists(os.path.join(ROOT, link)), link
