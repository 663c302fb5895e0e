"""The documentation: the site builds strictly (warnings are errors) with no network and loads nothing
from the internet; the README stays short and its links resolve; the generated references are
complete: every ESConfig field, and every metrics key the code writes or a run writes, has an entry."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from esft import ESConfig
from esft.runs.metric_keys import METRICS, SUMMARY, entry_for
from test_cli import esft, read_jsonl
from tiny_model import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "src" / "esft"
NO_NETWORK = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "ALL_PROXY": "http://127.0.0.1:9",
              "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}
"""Any HTTP(S) request of the build goes to a closed port on loopback: a build that needs the network fails."""
QUIET = {"NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
"""Material's and a plugin's banner about MkDocs 2 (the docs extra holds mkdocs < 2): not a warning of this build."""


def generator():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------- the site
@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]'; the README's test command has it)")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=subprocess_env() | NO_NETWORK | QUIET, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-5000:]
    return out


def test_every_page_of_the_navigation_is_built(site):
    import yaml

    def pages(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from pages(value) if isinstance(value, list) else [value]

    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    built = [site / page.removesuffix(".md") / "index.html" if page != "index.md" else site / "index.html"
             for page in pages(config["nav"])]
    assert len(built) >= 15 and [page for page in built if not page.is_file()] == []
    for written in DOCS.rglob("*.md"):  # a page left out of the navigation is unreachable
        name = written.relative_to(DOCS).as_posix()
        assert name in set(pages(config["nav"])), f"docs/{name} is not in mkdocs.yml's nav"


def test_the_site_loads_nothing_from_the_internet(site):
    """Scripts, stylesheets, images, fonts and frames come from the site itself (links to other sites are fine)."""
    loads = re.compile(r"<(?:script|img|iframe|source)\b[^>]*\bsrc=[\"'](https?:)?//|<link\b[^>]*\bhref=[\"'](https?:)?//"
                       r"|@import\s+url\(\s*[\"']?(https?:)?//|url\(\s*[\"']?https?://")
    offenders = {}
    for path in [*site.rglob("*.html"), *site.rglob("*.css"), *site.rglob("*.js")]:
        for found in loads.finditer(path.read_text(errors="replace")):
            context = path.read_text(errors="replace")[found.start():found.start() + 120]
            if "<link" in found.group(0) and not re.search(r"rel=[\"'](?:stylesheet|preload|icon|preconnect)", context):
                continue  # <link rel="canonical"> and the like load nothing
            offenders.setdefault(str(path.relative_to(site)), context)
        if path.suffix == ".html" and 'class="mermaid"' in path.read_text(errors="replace"):
            offenders[str(path.relative_to(site))] = "a mermaid diagram: Material loads mermaid.js from unpkg.com"
    assert offenders == {}


def test_search_works_from_the_sites_own_index(site):
    index = json.loads((site / "search" / "search_index.json").read_text())
    text = " ".join(doc["text"] + " " + doc["title"] for doc in index["docs"])
    for term in ("reward/std", "--sigma", "ESTrainer", "--trust-run-code"):
        assert term in text, term
    assert (site / "assets" / "javascripts").is_dir()  # the search code ships with the site


def test_the_generated_references_are_in_the_site(site):
    config = (site / "reference" / "config" / "index.html").read_text()
    for field in dataclasses.fields(ESConfig):
        assert "--" + field.name.replace("_", "-") in config, field.name
    metrics = (site / "reference" / "metrics" / "index.html").read_text()
    assert all(metric.key.replace("<", "&lt;").replace(">", "&gt;") in metrics for metric in METRICS + SUMMARY)
    api = (site / "reference" / "api" / "index.html").read_text()
    assert "train_dataset" in api and "resume_from_checkpoint" in api  # ESTrainer's docstrings, rendered


# ------------------------------------------------------------------------------------------- README
def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, "the README links into the docs"
    for link in links:
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else ROOT / "README.md"
        assert target.exists(), f"README links to {link}: no such file"
        if anchor and target.suffix == ".md":
            headings = re.findall(r"^#+\s+(.*)$", target.read_text(), re.MULTILINE)
            slugs = {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", h.strip().lower())) for h in headings}
            assert anchor in slugs, f"README links to {link}: no such heading in {path}"


def test_the_readme_gives_the_two_commands_that_ci_runs():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(python3 -m venv .*?)\n```", readme)
    assert len(commands) >= 2 and commands[0].endswith("esft train")
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci and "[docs" not in commands[0]
    assert "docs" in re.search(r'-e "\.\[([^\]]*)\]"', commands[1]).group(1).split(",")


# ------------------------------------------------------------------------------- the config reference
def test_the_config_reference_has_every_field_with_its_help_and_default():
    page = generator().config_page()
    for field in dataclasses.fields(ESConfig):
        row = next((line for line in page.splitlines() if line.startswith(f"| `--{field.name.replace('_', '-')}")), None)
        assert row is not None, f"{field.name} has no row in the configuration reference"
        assert " ".join(field.metadata["help"].split()).replace("|", "\\|")[:60] in row
        assert f"`{field.default}`".replace("|", "\\|") in row
        algorithms = field.metadata["algorithms"]
        assert f" | {'all' if len(algorithms) == 3 else ', '.join(algorithms)} | " in row  # which --algorithm it is for


def test_the_committed_reference_pages_are_what_the_code_makes_now():
    gen = generator()
    for path, page in gen.COMMITTED.items():
        assert (DOCS / path).read_text() == page(), f"docs/{path} is out of date: run python docs/gen_reference.py"


def test_the_algorithm_page_has_a_row_for_every_reward_shaping_and_no_other():
    """docs/algorithm.md's --reward-shaping table names exactly the registry's built-in shapings (one added without
    its row, or a row left after one is removed, fails here); a test's own registered shaping (user_extensions'
    sign, in this process when another test imported it) is not esft's."""
    from esft.es.shaping import REWARD_SHAPING

    page = (DOCS / "algorithm.md").read_text()
    table = page[page.index("| `--reward-shaping` | zᵢ |"):].split("\n\n")[0]
    rows = re.findall(r"^\| `([a-z_]+)`", table, flags=re.MULTILINE)
    assert rows == [name for name, entry in REWARD_SHAPING.items() if entry.shape.__module__.startswith("esft.es.shaping.")]
    assert len(rows) >= 6


def test_the_cli_reference_has_every_command():
    page = generator().cli_page()
    for command in ("train", "eval", "report", "serve-reward"):
        assert f"## esft {command}\n" in page
    assert "--out FILE.html" in page  # esft report's own flags, from its parser


# ------------------------------------------------------------------------------ the metrics reference
def metric_keys_in_code() -> set[str]:
    """Every metrics-like key the package spells (string literals and f-strings; an f-string's fields as <x>)."""
    prefixes = ("reward/", "rewards/", "eval/", "perf/", "budget/", "es/", "grpo/", "completions/")
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "metric_keys.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                text = "".join(part.value if isinstance(part, ast.Constant) else "<x>" for part in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            if text.startswith(prefixes) and re.fullmatch(r"[a-z_]+(/[\w@<>]+)+", text):
                found.add(text)
    return found


def test_every_metric_key_the_code_spells_has_an_entry():
    keys = metric_keys_in_code()
    assert {"reward/mean", "perf/tokens_per_s", "eval/<x>/<x>", "rewards/<x>/mean", "es/sigma"} <= keys
    for key in keys:
        pattern = re.escape(key).replace(re.escape("<x>"), r"[^/]+")
        assert any(re.fullmatch(pattern, metric.key) or metric.matches(key) for metric in METRICS + SUMMARY), \
            f"{key} (written in src/esft) has no entry in esft.runs.metric_keys.METRICS or SUMMARY"


LABELLED_TASK = '''
import sys
sys.path.insert(0, {examples!r})
from rewards import exact_answer, make_task


def judged(model_output, target, fast=False):
    """ES-at-Scale's per-sample convention: a (label, reward) pair, counted per label as rewards/judged/labels/<label>."""
    return ("short", 1.0) if len(model_output) < 6 else ("long", 0.0)


def labelled_task():
    task = make_task()
    task.reward_funcs = [exact_answer, judged]
    task.reward_weights = [1.0, 1.0]
    return task
'''


def test_every_key_an_es_run_writes_has_an_entry(tiny_model_dir, tmp_path):
    """A real CLI run with everything that adds keys: evaluation every iteration with K = 2 samples (pass@k,
    mean@k), a (label, reward) reward function, a σ schedule. No key of its metrics.jsonl is undocumented."""
    (tmp_path / "labelled.py").write_text(LABELLED_TASK.format(examples=str(ROOT / "examples" / "byo_task")))
    proc, _ = esft("train", "--model", str(tiny_model_dir), "--task", "labelled.py:labelled_task", "--max-tokens", "4",
                   "--population-size", "2", "--batch-size", "2", "--iterations", "2", "--eval-every", "1",
                   "--eval-samples", "2", "--temperature", "0.7", "--sigma-schedule", "linear", "--no-progress",
                   "--logging", "none", "--output-dir", str(tmp_path), "--run-name", "keys", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    keys = {key for row in read_jsonl(tmp_path / "keys" / "metrics.jsonl") for key in row}
    assert {"eval/easy/pass@2", "eval/easy/mean@2", "rewards/judged/mean", "es/sigma", "budget/tokens"} <= keys
    assert any(key.startswith("rewards/judged/labels/") for key in keys), sorted(keys)
    assert sorted(key for key in keys if entry_for(key) is None) == []


def test_a_key_without_an_entry_is_found():
    """The check above can fail: made-up keys have no entry, documented shapes do."""
    assert entry_for("reward/median") is None and entry_for("eval/easy/pass@x") is None
    assert entry_for("eval/easy/pass@16").key == "eval/<split>/pass@<k>"
    assert entry_for("rewards/brevity/labels/long").key == "rewards/<function>/labels/<label>"
