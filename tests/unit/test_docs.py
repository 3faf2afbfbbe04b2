"""The docs name only things that exist: every repository path (`shared/engine.py`, `deploy/k8s/...`), every
`python -m tandem.x.y` module and every relative markdown link (with its #anchor) in README.md and docs/*.md."""
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# A path starts with one of the repository's top-level folders or files; a word, '/', '.' or ':' before it means
# it is part of something else (a URL, /tmp/..., ../x, ./certs).
TOP_LEVEL = ("services", "shared", "kernels", "tools", "benchmarks", "deploy", "proto", "tests", "docs", ".ci")
TOP_FILES = ("Makefile", "Dockerfile", "docker-compose.yml", "docker-compose.override.yml", "setup.py",
             "pyproject.toml", "README.md")
PATH = re.compile(r"(?<![\w./:~$@-])((?:%s)/[\w./{},-]*[\w/}])" % "|".join(re.escape(d) for d in TOP_LEVEL))
FILE = re.compile(r"(?<![\w./:-])(%s)(?![\w.-])" % "|".join(re.escape(f) for f in TOP_FILES))
MODULE = re.compile(r"python3? (?:-P )?-m (tandem(?:\.[\w{},]+)+)(?![\w{},]|\.[<\w{])")  # not tandem.x.<tier>
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# Made by a documented command, never committed (deploy/docker/build.sh writes the wheelhouse).
GENERATED = {"deploy/docker/wheelhouse", "deploy/docker/wheelhouse/"}


def expand_braces(text: str) -> list[str]:
    """"services/{a,b}.py" -> ["services/a.py", "services/b.py"] (one level, as the shell does)."""
    match = re.search(r"\{([^{}]*)\}", text)
    if not match:
        return [text]
    return [expanded for option in match[1].split(",")
            for expanded in expand_braces(text[:match.start()] + option + text[match.end():])]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return {slug(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def doc_id(doc: Path) -> str:
    return str(doc.relative_to(REPO))


def test_expand_braces_and_slug():
    assert expand_braces("tandem.services.{gateway,decode}") == ["tandem.services.gateway", "tandem.services.decode"]
    assert slug("The OpenAI-compatible HTTP API") == "the-openai-compatible-http-api"
    assert slug("Quantized weights (`shared/quant/`)") == "quantized-weights-sharedquant"


def test_patterns_find_paths_and_modules_but_not_urls_or_placeholders():
    text = ("see `shared/engine.py`, services/gateway/router.py; http://h/services/x.py /tmp/shared/y ./tools/z "
            "../shared/ARCHITECTURE.md $TANDEM_CACHE/models deploy/k8s/... and `python -P -m tandem.services.flags`, "
            "python -m tandem.services.<tier>")
    assert [m[1] for m in PATH.finditer(text)] == ["shared/engine.py", "services/gateway/router.py", "deploy/k8s/"]
    assert [m[1] for m in MODULE.finditer(text)] == ["tandem.services.flags"]


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_repository_path_a_doc_names_exists(doc):
    text = doc.read_text()
    named = {path for m in PATH.finditer(text) for path in expand_braces(m[1])} | {m[1] for m in FILE.finditer(text)}
    missing = sorted(p for p in named if p not in GENERATED and not (REPO / p).exists())
    assert not missing, f"{doc_id(doc)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_module_a_doc_runs_exists(doc):
    named = {module for m in MODULE.finditer(doc.read_text()) for module in expand_braces(m[1])}
    missing = sorted(module for module in named if importlib.util.find_spec(module) is None)
    assert not missing, f"{doc_id(doc)} runs modules that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_relative_link_resolves(doc):
    broken = []
    for m in LINK.finditer(doc.read_text()):
        target = m[1]
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists() or REPO not in file.parents:
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{doc_id(doc)} has links that do not resolve: {broken}"
