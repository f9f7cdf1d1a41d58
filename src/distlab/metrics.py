"""What a run writes: ``metrics.jsonl`` (a line per logged step) and ``summary.json``."""

from __future__ import annotations

import json
from pathlib import Path


class RunLog:
    """Appends metric lines and writes the summary; only the main rank writes files."""

    def __init__(self, out_dir: str | Path, enabled: bool):
        self.enabled = enabled
        self.dir = Path(out_dir)
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._metrics = open(self.dir / "metrics.jsonl", "w")

    def log(self, **fields) -> None:
        if self.enabled:
            self._metrics.write(json.dumps(fields) + "\n")
            self._metrics.flush()  # a crashed run keeps every line it logged

    def summary(self, **fields) -> None:
        if self.enabled:
            (self.dir / "summary.json").write_text(json.dumps(fields, indent=2) + "\n")

    def close(self) -> None:
        if self.enabled:
            self._metrics.close()


def read_metrics(out_dir: str | Path) -> list[dict]:
    with open(Path(out_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_summary(out_dir: str | Path) -> dict:
    return json.loads((Path(out_dir) / "summary.json").read_text())
