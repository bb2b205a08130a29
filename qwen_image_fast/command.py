"""`qwen-image-fast render|compare|serve ...` (the console script; also `python -m qwen_image_fast`): the arguments
parsed once (cli/parser.py), then `render` and `compare` run by cli/ and `serve` by server/, which reuses the render
command's pieces in cli/. Here, above both, so that neither imports the other's command.

Bad input exits with status 2, argparse's usage line and one line saying what is wrong (cli/__init__.py says the
rest of what `render` guarantees).
"""

import signal
import sys

from .cli import INTERRUPTED, one_line, run_command
from .cli.parser import build_parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.options = argv[1:]  # the command's own options, as given (render --engine ray hands them to its actors)
    if args.command == "serve":  # uvicorn handles the signals: SIGTERM drains (server/main.py)
        from .server.main import plan_serve, serve_forever

        try:
            plan = plan_serve(args)
        except ValueError as e:
            args.parser.error(one_line(e))
        return serve_forever(args, *plan)
    return run_command(args)


def exit_main() -> int:
    """The console script and `python -m qwen_image_fast`: main(), then Ctrl-C ignored while the interpreter exits.
    The commands answer Ctrl-C themselves (130 and one line); one that lands in the last moments, once the command
    has returned (its summary printed), is answered here the same way, and one during the interpreter's teardown is
    ignored: never a traceback, nor death by the signal (status -2, no line)."""
    try:
        status = main()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("qwen-image-fast: interrupted", file=sys.stderr, flush=True)
        status = INTERRUPTED
    # CPython (3.11) marks a KeyboardInterrupt that leaves code run by exec() of a string (dataclasses and
    # namedtuple build their methods so, during imports) as unhandled even when the command caught it, and `python
    # -m` then ends by killing itself with SIGINT after the exit (status -2 after the command's line). Each exec of
    # a string clears the mark as it starts; SIGINT is ignored by now, so this one cannot set it again.
    exec("")
    return status
