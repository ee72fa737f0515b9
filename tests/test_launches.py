"""The launches' queue (tests/launches.py) that the multi-process tests rely on, on small commands of its own:
order, what a later round reads, a failure passed on to what reads it, a process group killed past its time."""

from __future__ import annotations

import sys
import time

import pytest

from launches import Launches


@pytest.fixture
def queue(tmp_path) -> Launches:
    q = Launches()
    q.root = tmp_path
    yield q
    q.stop_all()


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_commands_run_in_round_order_and_a_later_round_reads_an_earlier_ones_output(queue, tmp_path):
    order = tmp_path / "order"
    queue.command("first", timeout=60, make=lambda folder: {
        "argv": py(f"import os; open({str(order)!r}, 'a').write('first '); print(os.getcwd(), os.environ['SEEN'])"),
        "cwd": folder, "env": {"SEEN": "yes"}})
    queue.command("second", round=1, after=("first",), timeout=60, make=lambda folder: py(
        f"open({str(order)!r}, 'a').write('second {queue.get('first').stdout.strip()} ')"))
    queue.command("unused", timeout=60, make=lambda folder: py("raise SystemExit(1)"))
    queue.needed = {"second"}  # what the selected tests use; "first" is queued because "second" reads it
    queue.poll()  # starts the first of the queue in the background
    assert queue.running is not None and [n.name for n in queue.running.needs] == ["first"]
    assert queue.get("second").returncode == 0
    assert queue.get("first").stdout.split() == [str(tmp_path / "first"), "yes"]
    assert order.read_text() == f"first second {tmp_path / 'first'} yes "
    assert "unused" not in queue.done  # no selected test uses it


def test_a_failed_make_fails_what_reads_it_and_nothing_else(queue):
    def broken(folder):
        raise RuntimeError("no plan today")

    queue.command("broken", timeout=60, make=broken)
    queue.command("reader", round=1, after=("broken",), timeout=60, make=lambda folder: py("print('never')"))
    queue.command("other", round=1, timeout=60, make=lambda folder: py("print('ran')"))
    with pytest.raises(pytest.fail.Exception, match="making broken failed:(.|\n)*RuntimeError: no plan today"):
        queue.get("broken")
    with pytest.raises(pytest.fail.Exception, match="reader did not run: broken, which it reads, failed"):
        queue.get("reader")
    assert queue.get("other").stdout == "ran\n"


def test_a_command_past_its_time_is_killed_with_its_process_group(queue, tmp_path):
    pid_file = tmp_path / "child"
    # a child of the command, in its process group, that would outlive it
    code = ("import subprocess, sys, time; "
            f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    queue.command("sleeper", timeout=2, make=lambda folder: py(code))
    with pytest.raises(pytest.fail.Exception, match="did not finish in time"):
        queue.get("sleeper")
    child = int(pid_file.read_text())
    for _ in range(100):
        if not alive(child):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the command's child {child} outlived it")


def alive(pid: int) -> bool:
    """Running (a zombie, killed and not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
