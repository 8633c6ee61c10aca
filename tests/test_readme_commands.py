"""Every command the README shows (issue 52, item 7): a documented command that dies is a
defect a test must catch, not a user.

- each `kvray ...` line of the README (its code blocks, and inline commands without
  placeholders) parses with the real command line, and every `make` target it names exists;
- every `kvray` subcommand and `kvray bench` entry is documented there;
- every benchmark script answers `--help` (its imports and arguments are sound);
- the front doors run at their smallest size: `kvray generate` (what `make generate`
  runs) and `kvray sim study --plot` here; every `kvray bench` entry with `--quick`
  (offline, spec, kv-int8, tp, kernel-ab, planner, step-times):
  tests/test_bench_commands.py; `kvray bench serve`: tests/test_serve_openai.py; `kvray
  serve`: tests/test_serve_cli.py; `kvray sim plan/run/validate`:
  tests/test_sim_calibration.py; `kvray deploy` and `ray up`: tests/test_ray_up.py).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvray.cluster.cli import BENCHMARKS, build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()
# (vllm_offline.py runs under vLLM's own interpreter, started by offline_throughput.py)
ENTRIES = [p for p in (ROOT / "benchmarks").glob("*.py") if p.name != "vllm_offline.py"]
SCRIPTS = sorted(p.name for p in ENTRIES if "__main__" in p.read_text())


def _code_lines() -> list[str]:
    """The README's code-block lines, backslash continuations joined, comments dropped."""
    lines, inside, pending = [], False, ""
    for line in README.splitlines():
        if line.startswith("```"):
            inside = not inside
            continue
        if not inside:
            continue
        line, _, comment = (pending + line).partition("  #")
        if comment.strip().startswith("= "):  # `make serve  # = .venv/bin/kvray serve ...`
            lines.append(comment.strip()[2:])
        line = line.rstrip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        lines.append(line.strip())
    return lines


def _inline_commands() -> list[str]:
    """Inline commands as a user would paste them (`.venv/bin/kvray ...`; a bare `kvray
    ...` span in the prose may be a synopsis or a flag's name)."""
    return re.findall(r"`(\.venv/bin/kvray [^`]+)`", README)


def readme_kvray_commands() -> list[list[str]]:
    """The arguments of every kvray command the README shows (after `kvray`)."""
    commands = []
    for line in _code_lines() + _inline_commands():
        if not re.search(r"(^|[\s/])kvray ", line):
            continue
        words = shlex.split(line)
        at = next((i for i, w in enumerate(words) if w == "kvray" or w.endswith("/kvray")), None)
        if at is not None and (at == 0 or words[at - 1] in ("sudo", "=") or "=" in words[at - 1]):
            commands.append(words[at + 1 :])
            if "--" in words[at:] and "kvray" in words[words.index("--", at) :]:  # run inside a node
                commands.append(words[words.index("kvray", words.index("--", at)) + 1 :])
    return commands


COMMANDS = readme_kvray_commands()


def test_the_readme_shows_the_commands_this_test_reads():
    """The parsing above finds what is there (a README reworded out of its reach would
    make the next test pass vacuously)."""
    firsts = {c[0] for c in COMMANDS}
    assert {"generate", "serve", "deploy", "cluster", "sim", "bench"} <= firsts, firsts
    assert len(COMMANDS) >= 20


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c)[:60] for c in COMMANDS])
def test_each_readme_kvray_command_parses(argv):
    """...and the serve config it names loads (a preset name or a file of the checkout)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse's error (it printed which argument)
        pytest.fail(f"README's `kvray {shlex.join(argv)}` does not parse (exit {e.code})")
    if argv[0] in ("serve", "deploy") or argv[:2] == ["sim", "validate"]:
        from kvray.router.app import load_config

        config = str(ROOT / args.config) if args.config.endswith(".yaml") else args.config
        assert load_config(config).app_name


def test_every_make_target_the_readme_names_exists():
    code = "\n".join(_code_lines() + re.findall(r"`([^`\n]+)`", README))
    named = set(re.findall(r"(?:^|\s)make ([a-z][a-z-]*)", code, re.M))
    targets = set(re.findall(r"^([a-z][a-z-]*):", MAKEFILE, re.M))
    assert named and named <= targets, named - targets


def test_every_subcommand_and_bench_entry_is_documented():
    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    missing = [s for s in subcommands if f"kvray {s}" not in README]
    for name, script in BENCHMARKS.items():
        if f"kvray bench {name}" not in README and f"benchmarks/{script}" not in README:
            missing.append(name)
    assert not missing, missing


def _run(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-3000:])
    return done


@pytest.mark.slow
def test_every_benchmark_script_answers_help():
    """One process each, as a user starts them: an import or argument that breaks shows."""
    for name in SCRIPTS:
        out = _run([sys.executable, str(ROOT / "benchmarks" / name), "--help"], ROOT, 120).stdout
        assert "usage:" in out, name


def _kvray() -> list[str]:
    script = Path(sys.executable).with_name("kvray")  # the console script pip installed
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvray.cluster.cli"]


@pytest.mark.slow
def test_kvray_generate_answers(tmp_path, smollm2_path):
    """`make generate`'s command: the default model answers a short prompt."""
    argv = ["generate", "--prompt", "The capital of France is", "--max-tokens", "4"]
    out = _run([*_kvray(), *argv], tmp_path, 600)
    assert out.stdout.strip(), out.stderr[-2000:]


@pytest.mark.slow
def test_kvray_sim_study_plots(tmp_path):
    """The README's study, one workload and a short run: it once simulated for minutes and
    then died importing matplotlib; now the plot's figure is written."""
    argv = ["sim", "study", "--model", "llama-3.1-8b", "--gpu", "H100", "--num-gpus", "4"]
    assert argv in [c[: len(argv)] for c in COMMANDS]  # the README's own
    small = ["--workloads", "summarization", "--duration", "5", "--plot", "out/"]
    _run([*_kvray(), *argv, *small], tmp_path, 600)
    assert (tmp_path / "out" / "sim_summarization.png").stat().st_size > 0
