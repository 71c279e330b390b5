"""python -m megappo.config [--print | --check] [FILE]: the configuration reference table;
python -m megappo.config --verl-compat FILE: what each verl override in FILE becomes here.

Without options it rewrites the table between the ``config-reference`` markers of FILE (default:
the repository's ``docs/configuration.md``); ``--check`` only says whether that copy is current
(exit 1 when stale); ``--print`` prints the table. ``--verl-compat`` reads a verl launch command
or a file of overrides (``key=value`` tokens; comments, line continuations and other words are
skipped) and prints one line per override: set, mapped, accepted, warned, refused (with the
reason) or unknown; it exits 1 when any is refused or unknown, so a command can be checked before
booking GPUs."""
import argparse
import os
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
    mode.add_argument("--verl-compat", action="store_true",
                      help="FILE holds verl overrides (a launch command): say what each becomes here")
    args = ap.parse_args(argv)
    if args.verl_compat:
        return verl_compat_main(args.file)
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


def verl_compat_main(path: Path) -> int:
    from megappo.config.parse import verl_compat
    from megappo.config.shell import script_overrides

    if path == REFERENCE_DOC or not path.is_file():
        print(f"megappo.config --verl-compat: {path} is not a file of verl overrides", file=sys.stderr)
        return 2
    tokens = script_overrides(path.read_text(encoding="utf-8"), os.environ)
    bad = unchecked = 0
    for t in tokens:
        key, _, value = t.partition("=")
        if "$" in value:   # set by the shell when the script runs ($(command), a loop's variable)
            unchecked += 1
            print(f"{'unchecked':9s} {key.lstrip('+')}: its value comes from the shell at run time ({value})")
            continue
        status, key, what = verl_compat(t)
        bad += status in ("refused", "unknown")
        print(f"{status:9s} {key}: {what}")
    print(f"{len(tokens)} overrides: {bad} refused or unknown" + (f", {unchecked} unchecked" if unchecked else ""))
    return 1 if bad else 0


sys.exit(main())
