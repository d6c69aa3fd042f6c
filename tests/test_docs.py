"""Every Python code block of the documentation runs, so the docs cannot rot.

The blocks of one page run in order in one namespace (like a notebook), in a fresh working
directory. Conventions, also stated in docs/faq.md ("How are the docs tested?"):

- A block that is just a snippet include (``--8<-- "examples/x.py"``) shows a whole example
  script; the script must be one tests/test_recipes.py runs.
- ``http://127.0.0.1:9000`` (MinIO from docker-compose.yml) and ``http://127.0.0.1:4443``
  (fake-gcs-server) in a block are replaced by this session's S3 (moto) and GCS
  (fake-gcs-server) fixture servers, each with a bucket ``checkpoints``.
- A block right after ``<!-- docs-test: skip (reason) -->`` is not run: it needs something no
  test can have (real cloud credentials). Such blocks are counted and kept few.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parents[1]
DOCS = ROOT / "docs"
BLOCK = re.compile(
    r"(<!-- docs-test: skip \((?P<why>[^)]+)\) -->\s*\n)?^```python\n(?P<code>.*?)^```",
    re.S | re.M)
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"\s*$')
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))


def blocks(page: str) -> list[tuple[str, str | None]]:
    """(code, skip reason or None) of every ```python block of a page, in order."""
    text = (DOCS / page).read_text()
    return [(m["code"], m["why"]) for m in BLOCK.finditer(text)]


def test_there_are_pages_with_code_and_skips_stay_rare():
    all_blocks = [b for page in PAGES for b in blocks(page)]
    assert len(all_blocks) >= 20
    skipped = [why for _, why in all_blocks if why]
    assert len(skipped) <= 3, skipped


@pytest.fixture(scope="session")
def docs_servers(object_servers):
    """The moto and fake-gcs servers, each with the docs' bucket ``checkpoints``."""
    s3, gcs = object_servers["moto"], object_servers["fake-gcs"]
    for server in (s3, gcs):
        fs = server.fs()
        if not fs.exists("checkpoints"):
            fs.mkdir("checkpoints")
    return {"http://127.0.0.1:9000": s3, "http://127.0.0.1:4443": gcs}


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)])
def test_page_code_runs(page, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs_{page}"}
    for number, (code, skip) in enumerate(blocks(page), 1):
        if skip:
            continue
        snippet = SNIPPET.match(code.strip())
        if snippet:
            script = pathlib.Path(snippet["path"])
            assert (ROOT / script).is_file(), script
            assert script.name in (ROOT / "tests" / "test_recipes.py").read_text(), script
            continue
        if "127.0.0.1:9000" in code or "127.0.0.1:4443" in code:
            mapping = request.getfixturevalue("docs_servers")
            # One pass: a server's own port may begin with the other placeholder's (44435).
            code = re.sub("|".join(map(re.escape, mapping)),
                          lambda m, servers=mapping: servers[m.group(0)].endpoint_url, code)
        try:
            exec(compile(code, f"{page} block {number}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{page}, python block {number} failed:\n{code}") from e

