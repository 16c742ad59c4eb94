"""Test harness: real services (``services``), Kafka helpers (``kafka``), config and process helpers.

Import it as ``harness`` (``tests/`` is on ``sys.path`` because ``tests/conftest.py``
lives there): ``from harness import write_config, run_ingest, start_ingest`` and
``from harness.kafka import produce, end_offsets, committed_offsets, TEST_CONSUMER_SETTINGS``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from harness.services import die_with_parent, stop_process

REPO_ROOT = Path(__file__).resolve().parents[2]

__all__ = [
    "REPO_ROOT",
    "IngestProcess",
    "IngestTimeout",
    "ingest_command",
    "run_ingest",
    "start_ingest",
    "write_config",
]


def write_config(tmp_path: Path, data: Mapping, name: str = "ingest.yaml") -> Path:
    """Dump ``data`` as YAML to ``tmp_path / name`` and return the path."""
    path = Path(tmp_path) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(_plain(data), sort_keys=False, default_flow_style=False))
    return path


def _plain(obj):
    """Turn Paths, tuples and other mappings into YAML-safe builtins."""
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return obj


# --------------------------------------------------------------------------- ingest processes


def ingest_command(args: Sequence[str | os.PathLike]) -> list[str]:
    return [sys.executable, "-m", "ingest", *(os.fspath(a) for a in args)]


def _child_env(env: Mapping[str, str | None] | None) -> dict[str, str]:
    """The test process's environment minus the harness's own ``INGEST_TEST_*``
    variables, plus ``env`` (a ``None`` value removes a variable)."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_TEST_")}
    out["PYTHONUNBUFFERED"] = "1"
    for k, v in (env or {}).items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = str(v)
    return out


_seq = itertools.count(1)
_live: list["IngestProcess"] = []
_live_lock = threading.Lock()


def _log_paths(log_dir: str | os.PathLike | None) -> tuple[Path, Path]:
    d = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="ingest-run-"))
    d.mkdir(parents=True, exist_ok=True)
    n = next(_seq)
    return d / f"ingest-{os.getpid()}-{n}.stdout", d / f"ingest-{os.getpid()}-{n}.stderr"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _tail(text: str, n: int = 40) -> str:
    return "\n".join(text.splitlines()[-n:])


class IngestTimeout(subprocess.TimeoutExpired):
    """``run_ingest`` hit its timeout; the process was killed. Shows the output tails."""

    def __str__(self) -> str:
        return (f"{' '.join(self.cmd[2:])} did not exit within {self.timeout}s (killed)\n"
                f"--- stdout tail ---\n{_tail(self.output or '')}\n"
                f"--- stderr tail ---\n{_tail(self.stderr or '')}")


class IngestProcess(subprocess.Popen):
    """``subprocess.Popen`` for ``python -m ingest`` whose output goes to files.

    ``stdout_path`` / ``stderr_path`` name them; ``output()`` reads them;
    ``stop()`` sends a signal and waits; ``kill9()`` is SIGKILL and wait.
    """

    stdout_path: Path
    stderr_path: Path

    def output(self) -> tuple[str, str]:
        return _read(self.stdout_path), _read(self.stderr_path)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Send ``sig`` and wait up to ``timeout_s`` (then SIGKILL). Returns the exit status."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.send_signal(sig)
            try:
                self.wait(timeout_s)
            except subprocess.TimeoutExpired:
                stop_process(self, 5)
        return self.returncode

    def kill9(self) -> int:
        return self.stop(signal.SIGKILL, 10)

    def describe(self) -> str:
        out, err = self.output()
        return (f"{' '.join(self.args[2:])} -> {self.returncode}\n"
                f"--- stdout tail ({self.stdout_path}) ---\n{_tail(out)}\n"
                f"--- stderr tail ({self.stderr_path}) ---\n{_tail(err)}")


def start_ingest(args: Sequence[str | os.PathLike], env: Mapping[str, str | None] | None = None, *,
                 cwd: str | os.PathLike | None = None,
                 log_dir: str | os.PathLike | None = None) -> IngestProcess:
    """Start ``python -m ingest *args`` in the background, output to files in ``log_dir``
    (a fresh temp dir by default; pass ``tmp_path``). The process is killed when
    the test that started it ends (see conftest) and when pytest dies."""
    out_path, err_path = _log_paths(log_dir)
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = IngestProcess(
            ingest_command(args), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
            env=_child_env(env), cwd=cwd, preexec_fn=die_with_parent,
        )
    proc.stdout_path, proc.stderr_path = out_path, err_path
    with _live_lock:
        _live.append(proc)
    return proc


def run_ingest(args: Sequence[str | os.PathLike], *, timeout_s: float,
               env: Mapping[str, str | None] | None = None, cwd: str | os.PathLike | None = None,
               log_dir: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m ingest *args`` to completion; ``stdout``/``stderr`` are ``str``.

    Does not check the exit status. On timeout the process is killed and
    :class:`IngestTimeout` (a ``subprocess.TimeoutExpired``) is raised.
    """
    proc = start_ingest(args, env, cwd=cwd, log_dir=log_dir)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill9()
        out, err = proc.output()
        raise IngestTimeout(proc.args, timeout_s, output=out, stderr=err) from None
    finally:
        _forget(proc)
    out, err = proc.output()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _forget(proc: IngestProcess) -> None:
    with _live_lock:
        with contextlib.suppress(ValueError):
            _live.remove(proc)


def live_ingest_processes() -> list[IngestProcess]:
    with _live_lock:
        return list(_live)


def reap_ingest_processes(keep: Sequence[IngestProcess] = ()) -> list[IngestProcess]:
    """SIGKILL every process from :func:`start_ingest` still running, except ``keep``.
    Returns those that had to be killed."""
    killed = []
    for proc in live_ingest_processes():
        if any(proc is k for k in keep):
            continue
        if proc.poll() is None:
            proc.kill9()
            killed.append(proc)
        _forget(proc)
    return killed
