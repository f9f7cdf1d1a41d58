"""One module per chapter page, named after it: ``chapters/<page>.py`` holds the
experiments ``book/<page>.md`` runs (its test file is ``tests/chapters/test_<page>.py``,
its exercise checker, if any, ``distlab/exercises/<page>.py``). Functions here return
plain data for the page to show. May import the training library, ``scratch``, ``infra``
and ``tools``."""
