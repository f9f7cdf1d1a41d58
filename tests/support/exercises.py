"""Running an exercise checker in a test."""


def passes(check, *args, capsys) -> str:
    """Run ``check(*args)``, which must print exactly one ``passed: ...`` line;
    return it."""
    check(*args)
    line = capsys.readouterr().out.strip()
    assert line.startswith("passed: ") and "\n" not in line, line
    return line
