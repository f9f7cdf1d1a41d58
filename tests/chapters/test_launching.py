"""Starting the ranks: the page launches the example both ways on every build and
asserts what each rank received; these tests cover what it does not run: mp.spawn's
pickling errors, the environment diff, a launch that fails or hangs, and the commands
as a reader would type them."""

import sys

from distlab.chapters.launching import (
    Launch,
    _run,
    commands,
    received,
    short,
    try_spawn,
)


def test_spawn_needs_a_function_it_can_pickle_by_name():
    assert try_spawn(print, nprocs=1, timeout=60) == "ok"
    assert "pickle" in try_spawn(lambda rank: None, nprocs=1, timeout=60).lower()


def test_received_is_what_the_launcher_added_or_changed():
    launcher = {"PATH": "/bin", "OMP_NUM_THREADS": "4", "HOME": "/root"}
    rank = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "RANK": "3", "HOME": "/root"}
    assert received({"env": rank}, launcher) == {"OMP_NUM_THREADS": "1", "RANK": "3"}
    assert received({"env": launcher}, launcher) == {}


def test_long_values_are_cut_for_the_figure():
    assert short("localhost") == "localhost"
    assert short("9d27f826-2cf5-4fe1-9e28", 10) == "9d27f826-…"
    assert len(short("x" * 40, 10)) == 10


def test_the_commands_are_shown_as_a_reader_types_them():
    launches = {
        name: Launch(name, command, {}) for name, command in commands(3).items()
    }
    assert launches["mp.spawn"].shown() == (
        "python src/examples/spawn_example.py --nprocs 2 --steps 3 --device cpu"
    )
    assert (
        launches["torchrun"]
        .shown()
        .startswith(
            "torchrun --standalone --nproc-per-node=2 src/examples/spawn_example.py"
        )
    )


def test_a_failed_launch_reports_its_code_and_no_ranks(tmp_path):
    launch = Launch("broken", [sys.executable, "-c", "import sys; sys.exit(3)"], {})
    done = _run(launch, tmp_path, timeout=60)
    assert (done.returncode, done.reports) == (3, [])
    assert done.pid > 0


def test_a_hung_launch_is_killed_at_its_deadline(tmp_path):
    launch = Launch("hung", [sys.executable, "-c", "import time; time.sleep(60)"], {})
    done = _run(launch, tmp_path, timeout=2)
    assert done.returncode == -9 and done.reports == []
