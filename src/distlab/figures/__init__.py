"""The pictures pages draw from real objects and runs, one module per subject. Each
draws what a run or an object really holds, never a hand-made image. May import the
training library, ``costs``, ``scratch``, ``infra``, ``planner`` and ``tools``."""
