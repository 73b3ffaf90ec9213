"""The documentation holds together (issue 40, item 4): every relative link and ``#anchor`` in
README.md, docs/ and benchmarks/ resolves as GitHub resolves it, README.md stays the five-minute
story (at most 15 KB), and the commands the README and the guides show are the Makefile's
targets and the ``cluster-pipeline`` command's subcommands and options.

Markdown is read with markdown-it-py (CommonMark plus tables, what GitHub renders), so a link in
a code span or a code block is not a link, and a command is looked for only in code. Anchors
follow GitHub's rule for headings (github-slugger): the heading's text lowercased, every
character that is not a letter, a digit, ``_``, ``-`` or a space dropped, spaces turned into
``-``; a heading whose anchor is already taken gets ``-1``, ``-2``, ... in order.
"""

import argparse
import re
import shlex
from pathlib import Path
from urllib.parse import unquote

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

from cluster_pipeline.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# 15 KB read strictly: 15,000 bytes (TRL's README is 8.8 KB, torchtune's 23 KB).
README_MAX_BYTES = 15_000

_MD = MarkdownIt("commonmark").enable("table")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")  # http:, mailto:, //host: not ours


def documents() -> list[Path]:
    """The Markdown files whose links are checked: README.md, docs/**/*.md, benchmarks/*.md."""
    return [
        README,
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "benchmarks").glob("*.md")),
    ]


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (github-slugger, without the duplicate suffix)."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _walk(tokens: list[Token]):
    """Every token, inline ones included, with its source line (1-based): a block's first line,
    plus the line breaks before an inline token in its paragraph."""
    line = 1
    for token in tokens:
        if token.map is not None:
            line = token.map[0] + 1
        yield token, line
        child_line = line
        for child in token.children or []:
            if child.type in ("softbreak", "hardbreak"):
                child_line += 1
            yield child, child_line


def _heading_text(inline: Token) -> str:
    return "".join(
        child.content for child in inline.children or [] if child.type in ("text", "code_inline")
    )


def anchors(path: Path) -> set[str]:
    """The ``#anchors`` GitHub gives the headings of a Markdown file."""
    tokens = _MD.parse(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found: set[str] = set()
    for i, token in enumerate(tokens):
        if token.type != "heading_open":
            continue
        slug = github_slug(_heading_text(tokens[i + 1]))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(paths: list[Path]) -> list[str]:
    """Every relative link or image of ``paths`` whose file or ``#anchor`` does not exist, as
    ``file:line: link: why``; links with a scheme (``https:``, ``mailto:``) are not checked."""
    problems: list[str] = []
    anchor_cache: dict[Path, set[str]] = {}
    for path in paths:
        for token, line in _walk(_MD.parse(path.read_text(encoding="utf-8"))):
            if token.type not in ("link_open", "image"):
                continue
            target = str(token.attrGet("href") or token.attrGet("src") or "")
            if not target or _SCHEME.match(target):
                continue
            file_part, _, fragment = target.partition("#")
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}"
            linked = (path.parent / unquote(file_part)).resolve() if file_part else path
            if not linked.exists():
                problems.append(f"{where}: {target}: no such file")
                continue
            if not fragment:
                continue
            if linked.suffix != ".md" or linked.is_dir():
                problems.append(f"{where}: {target}: an anchor into a file that is not Markdown")
                continue
            if linked not in anchor_cache:
                anchor_cache[linked] = anchors(linked)
            if unquote(fragment) not in anchor_cache[linked]:
                problems.append(f"{where}: {target}: no heading with that anchor")
    return problems


def _code(path: Path) -> list[tuple[int, str]]:
    """The code of a Markdown file, line by line with its line number: a code span is one line;
    a code block's line that ends in a backslash goes on over the next one, as in a shell."""
    code = []
    for token, line in _walk(_MD.parse(path.read_text(encoding="utf-8"))):
        if token.type == "code_inline":
            code.append((line, token.content))
        elif token.type in ("fence", "code_block"):
            first = line + (1 if token.type == "fence" else 0)  # below the fence's ``` line
            command, start = "", first
            for offset, text in enumerate(token.content.splitlines()):
                if not command:
                    start = first + offset
                if text.endswith("\\"):
                    command += text[:-1] + " "
                    continue
                code.append((start, command + text))
                command = ""
            if command:
                code.append((start, command))
    return code


def _command_lines(code: str, program: str) -> list[list[str]]:
    """The words of every ``program ...`` command in a piece of code, up to a comment, a pipe,
    a redirection or the end of the line."""
    found = []
    for text in code.splitlines():
        try:
            words = shlex.split(text, comments=True)
        except ValueError:  # a code span holding half a command line
            words = text.split()
        for i, word in enumerate(words):
            if word == program or word.endswith(f"/{program}"):
                rest = []
                for w in words[i + 1 :]:
                    if w in ("|", ">", ">>", "&&", ";", "||") or w.startswith(">"):
                        break
                    rest.append(w)
                found.append(rest)
    return found


def _cli_options() -> dict[str, set[str]]:
    """``cluster-pipeline``'s subcommands and the options each takes, built as ``main`` builds
    them."""
    options = {}
    for name, module in COMMANDS.items():
        parser = argparse.ArgumentParser(prog=f"cluster-pipeline {name}")
        module.add_arguments(parser)
        options[name] = {o for action in parser._actions for o in action.option_strings}
    return options


def _make_targets_and_variables() -> tuple[set[str], str]:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*)\s*:(?!=)", makefile, re.M))
    return targets, makefile


def wrong_commands(paths: list[Path]) -> list[str]:
    """Every ``make <target> VAR=...`` and ``cluster-pipeline <command> --option`` in the code of
    ``paths`` that the Makefile or the command does not have, as ``file:line: command: why``."""
    targets, makefile = _make_targets_and_variables()
    cli = _cli_options()
    problems = []
    for path in paths:
        where_file = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for line, code in _code(path):
            for words in _command_lines(code, "make"):
                if not words or "=" in words[0] or words[0].startswith("-"):
                    continue  # `make` alone, or make's own options
                shown = " ".join(["make", *words])
                if words[0] not in targets:
                    problems.append(f"{where_file}:{line}: {shown}: no target {words[0]!r}")
                for word in words[1:]:
                    var = re.match(r"([A-Z][A-Z0-9_]*)=", word)
                    if var and not re.search(rf"\$\({var[1]}\)|^{var[1]}\s*\??=", makefile, re.M):
                        problems.append(f"{where_file}:{line}: {shown}: no variable {var[1]}")
            for words in _command_lines(code, "cluster-pipeline"):
                if not words:
                    continue
                shown = " ".join(["cluster-pipeline", *words])
                if words[0] not in cli:
                    problems.append(f"{where_file}:{line}: {shown}: no command {words[0]!r}")
                    continue
                for word in words[1:]:
                    if word == "--":
                        break  # what follows goes to dagster dev / mlflow ui
                    if word.startswith("--") and word.split("=")[0] not in cli[words[0]]:
                        problems.append(f"{where_file}:{line}: {shown}: no option {word}")
    return problems


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Run the main job (one command)", "run-the-main-job-one-command"),
        (
            "Step 3b: balance by tokens (this project's default)",
            "step-3b-balance-by-tokens-this-projects-default",
        ),
        (
            "Beside the paper's baselines: IFD, RDS+, S2L and LESS (issue 25)",
            "beside-the-papers-baselines-ifd-rds-s2l-and-less-issue-25",
        ),
        ("Clustering + selection", "clustering--selection"),
        ("Main job (make run)", "main-job-make-run"),
        ("Données_brutes à lire", "données_brutes-à-lire"),
    ],
)
def test_a_heading_gets_githubs_anchor(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_anchors_read_inline_code_and_number_repeated_headings(tmp_path: Path) -> None:
    doc = tmp_path / "a.md"
    doc.write_text(
        "# Main job (`make run`)\n\n## Notes\n\ntext\n\n## Notes\n\n```\n# not a heading\n```\n"
    )
    assert anchors(doc) == {"main-job-make-run", "notes", "notes-1"}


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "guide.md").write_text("# The guide\n\n## Two words\n")
    (tmp_path / "table.csv").write_text("a,b\n")
    doc = tmp_path / "index.md"
    doc.write_text(
        "# Index\n\n"
        "[ok](guide.md) [ok](guide.md#two-words) [ok](#index) [ok](https://x.org/#y)\n"
        "[file gone](gone.md)\n\n"
        "| a | b |\n|---|---|\n| [anchor gone](guide.md#three-words) | [csv](table.csv#x) |\n\n"
        "`[in code](gone.md)`\n\n"
        "[here gone](#nowhere)\n"
    )
    assert broken_links([doc]) == [
        f"{doc}:4: gone.md: no such file",
        f"{doc}:8: guide.md#three-words: no heading with that anchor",
        f"{doc}:8: table.csv#x: an anchor into a file that is not Markdown",
        f"{doc}:12: #nowhere: no heading with that anchor",
    ]


def test_the_checker_finds_a_command_the_makefile_or_the_cli_lacks(tmp_path: Path) -> None:
    doc = tmp_path / "commands.md"
    doc.write_text(
        "# Commands\n\n"
        "```bash\n"
        "make run DATASET=x   # fine\n"
        "make runn\n"
        "make test NO_SUCH_KNOB=1\n"
        ".venv/bin/cluster-pipeline export data --out DIR --overwrite\n"
        "cluster-pipeline export data --output DIR\n"
        "cluster-pipeline expor data\n"
        "cluster-pipeline dev -- -w workspace.yaml --anything\n"
        "make compare SELECTORS=ifd \\\n"
        "  NOPE=1\n"
        "```\n\n"
        "Also `make compare SELECTORS=ifd` and `make` alone.\n"
    )
    assert wrong_commands([doc]) == [
        f"{doc}:5: make runn: no target 'runn'",
        f"{doc}:6: make test NO_SUCH_KNOB=1: no variable NO_SUCH_KNOB",
        f"{doc}:8: cluster-pipeline export data --output DIR: no option --output",
        f"{doc}:9: cluster-pipeline expor data: no command 'expor'",
        f"{doc}:11: make compare SELECTORS=ifd NOPE=1: no variable NOPE",
    ]


def test_every_relative_link_and_anchor_resolves() -> None:
    problems = broken_links(documents())
    assert not problems, (
        "Broken links in the documentation (file:line: link: why). A guide that another branch "
        "writes (docs/guide/gpu.md, issue 39) resolves once that branch is merged:\n"
        + "\n".join(problems)
    )


def test_the_commands_in_readme_and_guides_exist() -> None:
    paths = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    problems = wrong_commands(paths)
    assert not problems, "Commands the Makefile or cluster-pipeline lacks:\n" + "\n".join(problems)


def test_readme_is_at_most_15_kb() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md is {size:,} bytes, over {README_MAX_BYTES:,}: it is the five-minute story "
        "(what it is, the two commands, one results table, a table of contents); move the "
        "detail into a guide under docs/ and link it from the table of contents"
    )


def test_ci_runs_the_readme_test_command() -> None:
    """The README's two commands are its first code blocks under their headings, and CI's entry
    point runs the test one as it is written there."""
    readme = README.read_text()
    run = re.search(r"## Run the main job.*?```bash\n(.*?)\n```", readme, re.S)
    test = re.search(r"## Run the tests.*?```bash\n(.*?)\n```", readme, re.S)
    assert run and test
    assert (run[1], test[1]) == ("make run", "make test")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test[1] in [line.strip() for line in ci]
