"""Running an exercise checker in a test."""


def passes(check, *args, capsys) -> str:
    """Run ``check(*args)``, which must print exactly one ``passed: ...`` message
    (wrapped to 88 columns, continuation lines indented); return it as one line."""
    check(*args)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines and lines[0].startswith("passed: "), lines
    assert all(line.startswith("  ") for line in lines[1:]), lines
    assert all(len(line) <= 88 for line in lines), lines
    return " ".join(line.strip() for line in lines)
