"""Every command in README.md and docs/*.md is checked, so the docs cannot drift from the code:

- a `curl` against the API runs against the shared tiny pdserve (the model renamed to it) and must answer
  without an error (tests/test_server_e2e.py runs the README's against smollm2-135m as well);
- a `pdserve`, `pdserve-worker`, `pdserve-client` or `pdserve-bench` command, in a bash block or inline,
  parses with that command's own parser (what needs a GPU, root or other machines cannot run here);
  `pdserve keygen` runs; the one example of a wrong flag must be refused;
- a script (deploy/*.sh, scripts/setup.sh, bench/run_load_gpu.sh) exists, is executable, and reads the
  variables and takes the subcommand the command gives it;
- any other command is one this file knows (`scp`, `kubectl`, `source .venv/bin/activate`, the test
  suite itself), or the test fails and names it;
- the metric names docs/api.md quotes are ones /metrics declares;
- the README stays under 200 lines and links every page of docs/.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
import tempfile
from pathlib import Path

import pytest

from test_server_harness import ROOT

pytestmark = pytest.mark.timeout(300)

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
URL = "http://127.0.0.1:8000"
OURS = ("pdserve", "pdserve-worker", "pdserve-client", "pdserve-bench")
KNOWN = {"scp", "kubectl", "grep", "openssl"}  # other tools a page shows, not ours to check
MEANT_TO_FAIL = {"pdserve --gpu-memory-utilization 0.9"}  # the page shows its one-line error


def bash_commands(page: Path) -> list[str]:
    """Each command line of the page's bash blocks (continuations joined, comments dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def inline_commands(page: Path) -> list[str]:
    prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    spans = (s.split() for s in re.findall(r"`([^`]+)`", prose))
    return [" ".join(s) for s in spans if len(s) > 1 and s[0] in OURS and not re.search(r"[|<]", " ".join(s))]


def pieces(line: str) -> list[list[str]]:
    """The simple commands of a line (split at && and |), each without its VAR=value prefixes and sudo."""
    line = re.sub(r"\$\([^)]*\)", "X", line)
    out = []
    for part in re.split(r"&&|\|", line):
        words = shlex.split(part)
        env = []
        while words and (re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]) or words[0] == "sudo"):
            env.append(words.pop(0))
        if words:
            out.append([*env, *words])
    return out


def parse_ours(words: list[str], tmp: Path) -> None:
    """Parse (or, for keygen, run) one of our commands; raises SystemExit(2) with the parser's message."""
    name, args = words[0], words[1:]
    if name == "pdserve":
        from pdserve.server import cli
        if args[:1] == ["keygen"]:
            assert cli.keygen([str(Path(tempfile.mkdtemp(dir=tmp)) / "keys")]) == 0
            return
        parser = cli.router_parser() if args[:1] == ["router"] else cli.pdserve_parser()
        parser.parse_args(args[1:] if args[:1] == ["router"] else args)
    elif name == "pdserve-worker":
        from pdserve.workers import cli
        if args[:1] == ["generate"]:
            cli.generate_parser().parse_args(args[1:])
        else:
            cli.serve_parser().parse_args(args)
    elif name == "pdserve-client":
        from pdserve.client import cli
        cli.build_parser().parse_args(args)
    elif name == "pdserve-bench":
        from pdserve.bench.cli import SUBCOMMANDS
        p = argparse.ArgumentParser(prog=f"pdserve-bench {args[0]}")
        importlib.import_module(SUBCOMMANDS[args[0]][0]).add_arguments(p)
        p.parse_args(args[1:])


def check_ours(words: list[str], tmp: Path) -> str | None:
    """None if the command parses; the parser's complaint if not."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse_ours(words, tmp)
    except SystemExit as e:
        if e.code not in (0, None):
            return (err.getvalue().strip().splitlines() or [str(e.code)])[-1]
    return None


def check_script(words: list[str]) -> str | None:
    env = [w.split("=")[0] for w in words if re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", w)]
    rest = [w for w in words if w not in env and "=" not in w and w != "sudo"]
    path = ROOT / rest[0]
    if not path.is_file() or not os.access(path, os.X_OK):
        return f"{rest[0]} is not an executable file"
    text = path.read_text()
    missing = [v for v in env if v not in text]
    if missing:
        return f"{rest[0]} reads no {missing}"
    if len(rest) > 1 and not re.search(rf"(^|\s|\|){re.escape(rest[1])}\)", text, re.M):
        return f"{rest[0]} has no `{rest[1]}` subcommand"
    return None


def test_every_command_in_the_docs_is_checked(tmp_path):
    wrong, seen = [], 0
    for page in PAGES:
        for line in bash_commands(page) + inline_commands(page):
            for words in pieces(line):
                seen += 1
                cmd = [w for w in words if not (re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", w) or w == "sudo")]
                if cmd[0].startswith(".venv/bin/") and cmd[0].removeprefix(".venv/bin/") in OURS:
                    cmd = [cmd[0].removeprefix(".venv/bin/"), *cmd[1:]]  # ours, run from the venv
                name = cmd[0]
                if name == "curl":
                    continue  # run against a live server below
                if name in OURS:
                    why = check_ours(cmd, tmp_path)
                    if line in MEANT_TO_FAIL:
                        why = None if why else "an example of a refused flag was accepted"
                elif name.endswith(".sh"):
                    why = check_script(words)
                elif name == "source":
                    why = None if cmd[1:] == [".venv/bin/activate"] else f"sources {cmd[1:]}"
                elif cmd[:4] == [".venv/bin/python", "-m", "pytest", "-q"] or name in KNOWN:
                    why = None
                elif name == "python":
                    why = None if (ROOT / cmd[1]).is_file() else f"{cmd[1]} does not exist"
                else:
                    why = "a command this check does not know: teach it the command or drop it from the page"
                if why:
                    wrong.append(f"{page.relative_to(ROOT)}: `{line}`: {why}")
    assert seen > 40, seen
    assert not wrong, "\n".join(wrong)


def test_every_curl_in_the_docs_answers(tiny_pdserve):
    curls = [line for page in PAGES for line in bash_commands(page) if line.startswith("curl ")]
    assert len(curls) >= 12
    for cmd in curls:
        cmd = cmd.replace(URL, tiny_pdserve.url).replace("smollm2-135m", "tiny")
        run = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip(), f"{cmd}\nexit {run.returncode}: {run.stderr}"
        assert '"error"' not in run.stdout, f"{cmd}\n{run.stdout[:500]}"


def test_the_metric_names_in_the_docs_exist():
    from pdserve.server.metrics import Metrics

    declared = {m.name for m in Metrics("tiny").registry.collect()}
    # a counter's samples carry _total; histograms _bucket/_sum/_count
    quoted = set(re.findall(r"`((?:pdserve_|vllm:)[a-z_:]+?)(?:_total|_count|_sum|_bucket)?(?:\{[^`]*\})?`",
                            (ROOT / "docs" / "api.md").read_text()))
    assert quoted, "no metric names found in docs/api.md"
    unknown = sorted(q for q in quoted if q not in declared and q.rstrip("*_") not in {"pdserve", "vllm"})
    assert not unknown, f"docs/api.md names metrics /metrics does not declare: {unknown}"


def test_the_readme_is_short_and_links_every_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    for page in (ROOT / "docs").glob("*.md"):
        assert f"](docs/{page.name})" in text, f"README.md does not link docs/{page.name}"


def test_every_table_in_the_docs_and_results_is_well_formed():
    """A table whose delimiter row has fewer cells than its header renders as raw text."""
    files = [*PAGES, *sorted((ROOT / "bench" / "results").rglob("*.md"))]
    bad = []
    for path in files:
        rows: list[list[str]] = []
        for line in path.read_text().splitlines() + [""]:
            if line.startswith("|"):
                rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))])
                continue
            if rows and (len(rows) < 2 or any(len(r) != len(rows[0]) for r in rows)
                         or not all(re.fullmatch(r":?-+:?", c) for c in rows[1])):
                bad.append(f"{path.relative_to(ROOT)}: the table headed {' | '.join(rows[0])[:80]!r}")
            rows = []
    assert not bad, "\n".join(bad)


def test_the_readme_begins_with_setup_and_serve_then_setup_and_test():
    """The README's first two commands: set up and run pdserve's embedded default; set up and run the
    tests, exactly as .ci/run does."""
    first = bash_commands(ROOT / "README.md")[:2]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert first[0].split("#")[0].strip() == "./scripts/setup.sh && .venv/bin/pdserve"
    assert first[1].split("#")[0].strip() == ci[-1].strip() == "./scripts/setup.sh && .venv/bin/python -m pytest -q -n 2"
