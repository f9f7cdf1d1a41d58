"""The comm-hook benchmark refuses a warm-up that would time PowerSGD's uncompressed
first steps."""

import pytest

from distlab.bench.comm_hooks import main


@pytest.mark.parametrize("argv", [["--warmup", "1"], ["--steps", "0"]])
def test_bad_arguments_end_in_one_line(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert "must be positive" in capsys.readouterr().err
