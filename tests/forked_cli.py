"""Run many command lines of the installed tools the way their console scripts run them, paying the imports once.

``python -m tests.forked_cli`` reads a JSON list of ``{"tool": "neusight-predict", "args": [...], "cwd": "..."}``
on stdin and writes a JSON list of ``{"returncode", "stdout", "stderr"}`` (same order) on stdout. It imports the
tools' entry points (as ``pyproject.toml``'s ``[project.scripts]`` name them, read from the installed
distribution) and the package once, then forks one child per command line: the child changes into ``cwd``, points
file descriptors 1 and 2 at files of its own, sets ``sys.argv`` and does what the generated console script does,
``sys.exit(main())``; its exit status is the command's. A command line still running after ``--timeout`` seconds
is killed (return code -9). What a fresh process would do differently is only the imports, done before the fork.

Why: each tool's process spends about 2 s importing torch, transformers and the package before it reads its
arguments; the bad-input tests run over 80 command lines (tests/test_cli.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from importlib.metadata import entry_points
from pathlib import Path


def _entry_points() -> dict:
    """Console-script name -> its ``main``, for the neusight distribution's scripts."""
    found = {}
    for ep in entry_points(group="console_scripts"):
        if ep.dist is not None and ep.dist.name == "neusight":
            found[ep.name] = ep.load()
    return found


def _exit_code(code) -> int:
    """The status ``sys.exit(code)`` ends a process with (None -> 0, an int as is, anything else printed -> 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(main, tool: str, args: list, cwd: str, out: str, err: str) -> None:
    code = 1
    try:
        fd_out = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        fd_err = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd_out, 1)
        os.dup2(fd_err, 2)
        os.chdir(cwd)
        sys.argv = [tool, *args]
        try:
            code = _exit_code(main())
        except SystemExit as e:
            code = _exit_code(e.code)
        except BaseException:   # as the interpreter reports an uncaught exception
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def run_all(commands: list[dict], jobs: int, timeout: float) -> list[dict]:
    mains = _entry_points()
    unknown = sorted({c["tool"] for c in commands} - set(mains))
    if unknown:
        raise SystemExit(f"forked_cli: {unknown} are not console scripts of the installed neusight ({sorted(mains)})")
    results: list = [None] * len(commands)
    with tempfile.TemporaryDirectory(prefix="forked_cli_") as tmp:
        running: dict[int, tuple[int, float]] = {}   # pid -> (command index, start time)
        todo = list(range(len(commands)))

        def reap(pid: int, status: int) -> None:
            i, _ = running.pop(pid)
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            results[i] = {"returncode": rc, "stdout": Path(tmp, f"{i}.out").read_text(errors="replace"),
                          "stderr": Path(tmp, f"{i}.err").read_text(errors="replace")}

        while todo or running:
            while todo and len(running) < jobs:
                i = todo.pop(0)
                c = commands[i]
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(mains[c["tool"]], c["tool"], list(c["args"]), c["cwd"], str(Path(tmp, f"{i}.out")),
                           str(Path(tmp, f"{i}.err")))
                running[pid] = (i, time.monotonic())
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid:
                reap(pid, status)
                continue
            now = time.monotonic()
            for pid, (_, start) in list(running.items()):
                if now - start > timeout:
                    os.kill(pid, signal.SIGKILL)
                    reap(*os.waitpid(pid, 0))
            time.sleep(0.02)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="command lines running at once")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a command line is killed")
    opts = parser.parse_args()
    commands = json.load(sys.stdin)
    importlib.import_module("neusight.api")   # torch, transformers and the package: what every command imports

    json.dump(run_all(commands, opts.jobs, opts.timeout), sys.stdout)


if __name__ == "__main__":
    main()
