"""Errors that mean "the run was asked for something wrong", not "the code has a bug".

A lab turns these into one line on stderr and a non-zero exit status (see ``cli.run``);
anything else keeps its full traceback, because then the traceback is what a
developer needs.
"""


class UserError(Exception):
    """Bad input or a failed run that the user can fix: a message, not a traceback."""
