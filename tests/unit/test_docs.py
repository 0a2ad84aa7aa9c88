"""The documentation's checks, in the fast tier (``make check``) and so in ``make test`` and CI.

- ``docs/operations/configuration.md`` and ``cli.md`` are what ``scripts/gen_docs.py`` renders from
  ``umbp/config.py`` and the ``umbp`` parsers (fix: ``make docs-gen``, then commit);
- ``README.md`` stays a short guide: at most 300 lines, its quick start's two commands first, its relative links
  resolving;
- no Markdown file outside ``docs/benchmarks/`` (and ``CHANGELOG.md``) holds a date or a commit hash: measurements
  and their history live in ``docs/benchmarks/`` and in git, not in the guide;
- the site builds with ``mkdocs build --strict`` (a broken link or anchor, or a page missing from ``mkdocs.yml``'s
  nav, fails it).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 300
# Pages that may carry dates and commit hashes: the benchmark tables are headed by machine and date.
DATED = ("docs/benchmarks/", "CHANGELOG.md")

DATE = re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")
HEX = r"[0-9a-f]{7,40}"
HASH_IN_BACKTICKS = re.compile(rf"`({HEX})`")
HASH_IN_CONTEXT = re.compile(rf"\b(?:commits?|tree|hash|sha)\b\W{{0,3}}(?:\w+\W+){{0,2}}?`?({HEX})\b", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _has_digit(text: str) -> bool:
    return any(c.isdigit() for c in text)


def dated_lines(text: str) -> list[tuple[int, str]]:
    """(line number, what was found) for every date or commit hash in ``text``."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        found += [(n, m.group(0)) for m in DATE.finditer(line)]
        # In backticks: a digit and a letter both (`1048576` and `acceded` are not hashes); after "commit", "tree",
        # "hash" or "sha": any hex run with a digit (short hashes can be all digits: "the tree of `6240132`").
        found += [(n, m.group(1)) for m in HASH_IN_BACKTICKS.finditer(line)
                  if _has_digit(m.group(1)) and not m.group(1).isdigit()]
        found += [(n, m.group(1)) for m in HASH_IN_CONTEXT.finditer(line)
                  if _has_digit(m.group(1)) and (n, m.group(1)) not in found]
    return found


def markdown_files() -> list[Path]:
    """The repository's Markdown files: tracked and untracked-but-not-ignored (so .venv, caches, site/ are out)."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.md"], cwd=ROOT, check=True,
                             capture_output=True, text=True, timeout=60).stdout
        return sorted(ROOT / p for p in out.splitlines() if (ROOT / p).is_file())
    except (OSError, subprocess.SubprocessError):  # not a git checkout (an unpacked tarball)
        skip = {".venv", ".git", "site", "build", ".pytest_cache", "node_modules"}
        return sorted(p for p in ROOT.rglob("*.md") if not skip & set(p.relative_to(ROOT).parts))


def test_generated_references_match_the_code():
    gen = _gen_docs()
    stale = [str(path.relative_to(ROOT)) for path, text in gen.rendered().items()
             if not path.exists() or path.read_text() != text]
    assert not stale, f"{', '.join(stale)} differ from the code: run `make docs-gen` (scripts/gen_docs.py) and commit"


def test_generated_references_cover_every_field_and_subcommand():
    from umbp import config
    from umbp.cli import build_parser

    gen = _gen_docs()
    text = gen.render_configuration()
    for cls in (config.MetaserverConfig, config.NodeConfig, config.ClientConfig):
        for f in config.dataclasses.fields(cls):
            assert f"`UMBP_{f.name.upper()}`" in text, f"{cls.__name__}.{f.name} missing from configuration.md"
    cli = gen.render_cli()
    for name, sub in gen._subcommands(build_parser()):
        assert f"## umbp {name}\n" in cli
        for action in sub._actions:
            for opt in action.option_strings:
                if opt not in ("-h", "--help"):
                    assert f"`{opt}" in cli or f", {opt}" in cli, f"umbp {name} {opt} missing from cli.md"


def test_readme_is_short_and_starts_with_the_quick_start():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): "
                                            "move detail into docs/")
    first_block = []
    inside = False
    for line in lines:
        if line.startswith("```"):
            if inside:
                break
            inside = True
        elif inside:
            first_block.append(line.split("#")[0].strip())
    assert first_block == ["make demo", "make test"], f"the README's first commands are {first_block}"


def test_no_dates_or_commit_hashes_outside_the_benchmark_pages():
    files = markdown_files()
    assert ROOT / "README.md" in files
    offenders = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(DATED) or rel in DATED:
            continue
        offenders += [f"{rel}:{n}: {what}" for n, what in dated_lines(path.read_text(errors="replace"))]
    assert not offenders, ("dates and commit hashes belong in docs/benchmarks/ (and git), not here:\n"
                           + "\n".join(offenders))


def test_the_date_and_hash_detectors():
    assert dated_lines("measured 2026-12-04 on the VM") == [(1, "2026-12-04")]
    assert dated_lines("on the tree of `6240132`") == [(1, "6240132")]
    assert dated_lines("the code before (commit a9b22e6), run") == [(1, "a9b22e6")]
    assert dated_lines("`1048576` bytes, `deadbeef`, 0x1A, `umbp up`, a commit record, 12-04") == []
    assert dated_lines("`e83c0e7` and `ba4bed6`") == [(1, "e83c0e7"), (1, "ba4bed6")]


def test_relative_links_in_readmes_resolve():
    broken = []
    for readme in (ROOT / "README.md", ROOT / "deploy" / "README.md"):
        for target in LINK.findall(readme.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#")[0]
            if not (readme.parent / path).exists():
                broken.append(f"{readme.relative_to(ROOT)}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.fail("mkdocs and mkdocs-material are missing: they are test extras (pip install -e '.[test]', "
                    "or make test-venv)")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert (tmp_path / "site" / "index.html").exists()
