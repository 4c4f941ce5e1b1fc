"""Services started by the launcher end with it, asked for by the service itself after exec (no preexec_fn,
which can deadlock a child of a threaded launcher before exec)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from specsplit.transport.serving import LAUNCHER_PID_ENV

SERVICE = ("from specsplit.transport.serving import exit_with_launcher; exit_with_launcher(); "
           "import time; time.sleep(120)")
LAUNCHER = f"""
import os, subprocess, sys, time
env = dict(os.environ, {LAUNCHER_PID_ENV}=str(os.getpid()))
p = subprocess.Popen([sys.executable, "-c", {SERVICE!r}], env=env, start_new_session=True)
print(p.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (not yet reaped by init) counts as gone
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_a_service_ends_when_its_launcher_is_killed() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        service = int(launcher.stdout.readline())
        time.sleep(2.0)  # the service has run exit_with_launcher
        assert _alive(service)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 20
        while _alive(service) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(service), "the service outlived its launcher"
    finally:
        launcher.kill()
        launcher.wait()


def test_a_service_whose_launcher_is_gone_exits_at_once() -> None:
    env = dict(os.environ, **{LAUNCHER_PID_ENV: "1"})  # not our parent: the launcher is gone
    r = subprocess.run([sys.executable, "-c", SERVICE], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "launcher exited" in r.stderr


def test_without_the_variable_nothing_changes() -> None:
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_PID_ENV}
    code = "from specsplit.transport.serving import exit_with_launcher; exit_with_launcher(); print('ran')"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ran"


def test_a_garbled_variable_is_a_clear_error() -> None:
    env = dict(os.environ, **{LAUNCHER_PID_ENV: "not-a-pid"})
    r = subprocess.run([sys.executable, "-c", SERVICE], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "is not a process id" in r.stderr and "Traceback" not in r.stderr
