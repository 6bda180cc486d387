import os
import signal

import pytest

from builder.child_process import ChildProcessFailed, run_in_child_process


def add_and_log(a, b, log):
    log(f"adding in process {os.getpid()}")
    return a + b


def refuse(message, log):
    raise ValueError(message)


class ExceptionWithTwoArguments(Exception):
    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def raise_unpicklable(log):
    raise ExceptionWithTwoArguments("needs a code", 7)


def die(log):
    log("about to die")
    os.kill(os.getpid(), signal.SIGKILL)


def test_the_result_comes_back_and_log_lines_arrive_as_the_child_runs():
    lines = []
    assert run_in_child_process(add_and_log, (2, 3), lines.append, "adding") == 5
    assert len(lines) == 1 and lines[0].startswith("adding in process ")
    assert int(lines[0].split()[-1]) != os.getpid()


def test_an_exception_in_the_child_is_raised_here_as_the_same_type():
    with pytest.raises(ValueError, match="^no such checkpoint$"):
        run_in_child_process(refuse, ("no such checkpoint",), print, "refusing")


def test_an_exception_pickle_cannot_rebuild_arrives_as_a_failure_with_its_message():
    with pytest.raises(ChildProcessFailed, match="ExceptionWithTwoArguments: needs a code"):
        run_in_child_process(raise_unpicklable, (), print, "raising")


def test_a_child_killed_without_a_result_is_an_error_naming_the_step_and_the_signal():
    lines = []
    with pytest.raises(ChildProcessFailed, match=r"the build of rank 1 ended without a result: killed by signal 9"):
        run_in_child_process(die, (), lines.append, "the build of rank 1")
    assert lines == ["about to die"]
