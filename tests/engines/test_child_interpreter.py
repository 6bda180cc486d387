"""engines/child_interpreter.py: a fresh interpreter that imports the packages and talks over its socket pair."""

from __future__ import annotations

from engines.child_interpreter import PACKAGE_ROOT, start_child_interpreter

ECHO = (
    "import sys; from multiprocessing.connection import Connection; import engines; "
    "c = Connection(int(sys.argv[1])); c.send((sys.argv[2:], engines.__file__, c.recv() * 2))"
)


def test_the_child_imports_the_packages_gets_its_arguments_and_answers():
    process, connection = start_child_interpreter(ECHO, ["a", "b"])
    try:
        connection.send(21)
        args, module_file, answer = connection.recv()
    finally:
        connection.close()
        process.wait()
    assert args == ["a", "b"] and answer == 42 and module_file.startswith(PACKAGE_ROOT)
    assert process.returncode == 0
