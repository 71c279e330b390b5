"""python -m megappo.config [--print | --check] [FILE]: the configuration reference table.

Without options it rewrites the table between the ``config-reference`` markers of FILE (default:
the repository's ``docs/configuration.md``); ``--check`` only says whether that copy is current
(exit 1 when stale); ``--print`` prints the table."""
import argparse
import sys
from pathlib import Path

from megappo.config.docs import REFERENCE_DOC, config_reference_markdown, reference_in, with_reference


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megappo.config", description=__doc__.split("\n")[0])
    ap.add_argument("file", nargs="?", type=Path, default=REFERENCE_DOC,
                    help="markdown file holding the reference between its markers (default: %(default)s)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--print", action="store_true", help="print the table instead of writing it")
    mode.add_argument("--check", action="store_true", help="exit 1 when FILE's copy is stale")
    args = ap.parse_args(argv)
    table = config_reference_markdown()
    if args.print:
        print(table)
        return 0
    if not args.file.is_file():
        print(f"megappo.config: {args.file} does not exist (use --print for the table alone)", file=sys.stderr)
        return 2
    text = args.file.read_text(encoding="utf-8")
    if reference_in(text) is None:
        print(f"megappo.config: {args.file} has no config-reference markers", file=sys.stderr)
        return 2
    if args.check:
        current = reference_in(text) == table.strip()
        print(f"{args.file}: {'current' if current else 'stale: run python -m megappo.config'}")
        return 0 if current else 1
    new = with_reference(text, table)
    if new != text:
        args.file.write_text(new, encoding="utf-8")
    print(f"{args.file}: configuration reference {'rewritten' if new != text else 'already current'}")
    return 0


sys.exit(main())
