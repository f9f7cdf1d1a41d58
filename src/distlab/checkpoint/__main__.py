"""Convert a sharded checkpoint into the plain ``model.pt`` that every lab loads
(``--init-from``):

    python -m distlab.checkpoint to-plain runs/lab4/checkpoints/step_000200 model.pt

It runs in one process, with no process group, whatever number of ranks saved the
checkpoint, and keeps only the model (the optimizer and the RNG states stay behind).
Only convert checkpoints you trust: DCP's ``.metadata`` is a Python pickle.
"""

from __future__ import annotations

import argparse

from distlab.checkpoint.plain import to_plain


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m distlab.checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser(
        "to-plain", help="write the model as one plain state dict file"
    )
    convert.add_argument("checkpoint", help="a step_NNNNNN folder")
    convert.add_argument("out", help="the .pt file to write")
    args = parser.parse_args(argv)
    weights = to_plain(args.checkpoint, args.out)
    print(
        f"wrote {args.out}: {len(weights)} tensors, "
        f"{sum(t.numel() for t in weights.values()):,} values (the tied head "
        "counted twice)"
    )


if __name__ == "__main__":
    from distlab.cli import run

    run(main, "python -m distlab.checkpoint")
