"""The documentation's commands and links stay true to the code.

Every `harness ...` command shown in README.md and docs/**/*.md (in fenced code blocks, and in inline
code spans that start with `harness `) must parse with the real command line (harness.cli.build_parser);
a `harness run` command must also pass the job spec's checks (harness.spec.validate, with missing
dataset and checkpoint paths allowed, since docs name placeholders such as DIR). A `harness run` or
`harness preflight` command with `--dry-run` is run for real, in this process, and must exit 0 without
writing a file. Every relative link must point at a file that exists (and at a heading that exists,
where it names one), every docs page must be reachable from the README, and the README stays short. A fenced
```python block after a `<!-- test: run -->` line is run, in a fresh folder, and must not fail.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from pathlib import Path

import pytest

from harness.cli import _spec_from_args, build_parser, main
from harness.errors import HarnessError
from harness.spec import validate

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 230

# Fenced blocks in these languages hold no shell commands (Python, manifests, dashboards).
NOT_SHELL = {"python", "py", "json", "yaml", "yml", "toml", "ini", "promql", "dockerfile", "containerfile"}
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([^\s`]*)")
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
# `harness` where a shell command starts: line start, after a prompt `$`, an operator, or NAME=value words.
AT_COMMAND = re.compile(r"(?:^|&&|\|\||[|;&])\s*(?:\$\s+)?(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*harness\s")
OPERATORS = {"&&", "||", "|", ";", "&"}
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def strip_comment(line: str) -> str:
    """The line without a shell comment: an unquoted `#` at the start of a word and what follows it."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def harness_commands(text: str) -> list[list[str]]:
    """The `harness ...` commands in one shell line (continuations already joined), each as its words."""
    text = strip_comment(text)
    if not AT_COMMAND.search(text):
        return []
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")  # `a; b`, `a&&b` split as a shell does
    lexer.whitespace_split, lexer.commenters = True, ""
    words = list(lexer)  # a doc line with broken quoting raises here, and the test names it
    commands, current = [], []
    for word in [*words, ";"]:
        if word in OPERATORS:
            while current and (current[0] == "$" or ASSIGNMENT.match(current[0])):
                current.pop(0)
            if current and current[0] == "harness":
                commands.append(current)
            current = []
        else:
            current.append(word)
    return commands


def inline_commands(paragraph: str, first_line: int) -> list[tuple[int, str]]:
    """Commands in the inline code spans of one paragraph (a span may wrap onto the next line)."""
    found = []
    for span in INLINE.finditer(paragraph):
        text = " ".join(span.group(1).split())
        if text.startswith("harness "):
            try:
                commands = harness_commands(text)
            except ValueError as exc:
                commands = [["harness", f"<unreadable span: {exc}>"]]
            number = first_line + paragraph.count("\n", 0, span.start())
            found += [(number, shlex.join(c)) for c in commands]
    return found


def shown_commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command text) of every harness command shown in one Markdown file."""
    found: list[tuple[int, str]] = []
    fence, language, pending, pending_line = None, "", "", 0
    paragraph, paragraph_line = [], 0
    for number, line in enumerate([*path.read_text().splitlines(), ""], start=1):
        opened = FENCE.match(line)
        if fence is None and (opened or not line.strip()):
            found += inline_commands("\n".join(paragraph), paragraph_line)
            paragraph = []
        if fence is None and opened:
            fence, language = opened.group(1), opened.group(2).lower()
            continue
        if fence is not None:
            if line.strip().startswith(fence[0] * 3) and line.strip().strip(fence[0]) == "":
                fence, pending = None, ""
                continue
            if language in NOT_SHELL:
                continue
            if not pending:
                pending_line = number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            whole, pending = pending + line, ""
            try:
                commands = harness_commands(whole)
            except ValueError as exc:
                commands = [["harness", f"<unreadable line: {exc}>"]]
            found += [(pending_line, shlex.join(c)) for c in commands]
            continue
        if line.strip():
            if not paragraph:
                paragraph_line = number
            paragraph.append(line)
    return sorted(found)


def all_commands() -> list:
    params, seen = [], set()
    for path in doc_files():
        for number, command in shown_commands(path):
            if (path, command) in seen:
                continue
            seen.add((path, command))
            params.append(pytest.param(rel(path), number, command, id=f"{rel(path)}:{number}: {command}"))
    return params


COMMANDS = all_commands()
DRY_RUNS = [p for p in COMMANDS if "--dry-run" in shlex.split(p.values[2])
            and shlex.split(p.values[2])[1:2] in (["run"], ["preflight"])]


def subcommands() -> set[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return set(action.choices)


def test_the_docs_show_commands():
    """The extraction itself works: the README's set-up and usage commands are found."""
    shown = {command for _, command in shown_commands(README)}
    assert "harness run resnet" in shown
    assert any(c.startswith("harness compare ") for c in shown)
    assert DRY_RUNS, "no --dry-run command found in the docs"


@pytest.mark.parametrize("doc, line, command", COMMANDS)
def test_documented_command_parses(doc, line, command):
    args = shlex.split(command)[1:]
    where = f"{doc}:{line}: `{command}`"
    assert not any(a.startswith("<unreadable") for a in args), f"{where}: {args[-1]}"
    if len(args) == 1 and not args[0].startswith("-"):  # the command named in prose, e.g. `harness logs`
        assert args[0] in subcommands(), f"{where}: no such command; harness has {sorted(subcommands())}"
        return
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            parsed = build_parser().parse_args(args)
    except HarnessError as exc:
        pytest.fail(f"{where} does not parse: {exc}")
    except SystemExit as exc:  # --help and --version exit 0 after printing
        if exc.code not in (0, None):
            pytest.fail(f"{where} does not parse: {err.getvalue().strip() or exc}")
        return
    if parsed.command == "run":
        try:
            validate(_spec_from_args(parsed), dry_run=True, paths_here=False)
        except HarnessError as exc:
            pytest.fail(f"{where} is refused: {exc}")


@pytest.mark.parametrize("doc, line, command", DRY_RUNS)
def test_documented_dry_run_runs(doc, line, command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a dry run writes nothing: any file it made would show up here
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(shlex.split(command)[1:])
    assert code == 0, f"{doc}:{line}: `{command}` exited {code}:\n{err.getvalue()}"
    assert out.getvalue().strip(), f"{doc}:{line}: `{command}` printed no request"
    assert not list(tmp_path.iterdir()), f"{doc}:{line}: `{command}` wrote {sorted(tmp_path.iterdir())}"


RUN_MARK = "<!-- test: run -->"  # the fenced ```python block after this line is run by the test below


def python_examples() -> list:
    """(doc, line, code) of every fenced ```python block right after a RUN_MARK line, in every doc."""
    params = []
    for path in doc_files():
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.strip() != RUN_MARK:
                continue
            start = next(i for i in range(number + 1, len(lines)) if lines[i].strip())
            opened = FENCE.match(lines[start])
            assert opened and opened.group(2).lower() in ("python", "py"), \
                f"{rel(path)}:{number + 1}: {RUN_MARK} is not followed by a ```python block"
            end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == opened.group(1))
            params.append(pytest.param(rel(path), start + 2, "\n".join(lines[start + 1:end]),
                                       id=f"{rel(path)}:{start + 2}"))
    return params


PYTHON_EXAMPLES = python_examples()


def test_the_api_docs_have_an_example_that_runs():
    assert any(doc == "docs/api.md" for doc, _, _ in (p.values for p in PYTHON_EXAMPLES))


@pytest.mark.parametrize("doc, line, code", PYTHON_EXAMPLES)
def test_documented_python_runs(doc, line, code, tmp_path, monkeypatch, capsys):
    """A marked example runs as shown, in a fresh folder that holds only the repository's baselines, and writes
    nothing there."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "baselines").symlink_to(REPO / "results" / "baselines")
    monkeypatch.chdir(tmp_path)
    exec(compile("\n" * (line - 1) + code, str(REPO / doc), "exec"), {"__name__": "__doc_example__"})
    assert capsys.readouterr().out.strip(), f"{doc}:{line}: the example printed nothing"
    assert sorted(os.listdir(tmp_path)) == ["results"] and os.listdir(tmp_path / "results") == ["baselines"], \
        f"{doc}:{line}: the example wrote files"


def without_code(text: str) -> str:
    """The Markdown without fenced blocks and inline code, where brackets are not links."""
    kept, fence = [], None
    for line in text.splitlines():
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)
            continue
        if fence is not None:
            if line.strip().startswith(fence[0] * 3) and line.strip().strip(fence[0]) == "":
                fence = None
            continue
        kept.append(INLINE.sub("", line))
    return "\n".join(kept)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a page's headings."""
    found = set()
    for line in without_code(path.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            title = heading.group(1).strip().lower().replace("`", "")
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def links(path: Path) -> list[str]:
    return LINK.findall(without_code(path.read_text()))


@pytest.mark.parametrize("doc", [rel(p) for p in doc_files()])
def test_relative_links_point_at_files_that_exist(doc):
    path = REPO / doc
    broken = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target} (no {resolved.relative_to(REPO) if resolved.is_relative_to(REPO) else resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {rel(resolved)})")
    assert not broken, f"{doc}: broken links: {', '.join(broken)}"


def test_every_docs_page_is_linked_from_the_readme_and_links_back():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README)}
    pages = sorted(DOCS.rglob("*.md"))
    assert pages, "docs/ has no pages"
    assert not [rel(p) for p in pages if p.resolve() not in linked], "docs pages the README does not link"
    back = [rel(p) for p in pages if README.resolve() not in
            {(p.parent / t.partition("#")[0]).resolve() for t in links(p)}]
    assert not back, f"docs pages without a link back to the README: {back}"


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; keep it to {README_MAX_LINES}"
