"""The ``memplan`` command line. Each command lives in ``memplan.commands.<name>``."""

from __future__ import annotations

import importlib
import os
import sys

import typer

from memplan.errors import MemplanError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Plan the memory of PyTorch training and inference steps without changing their math.",
)

COMMAND_MODULES = ("analyze", "demo", "optimize", "place", "remat", "run")

for _name in COMMAND_MODULES:
    importlib.import_module(f"memplan.commands.{_name}").register(app)


def main() -> None:
    """Entry point: a MemplanError becomes one line on stderr and exit code 2."""
    # kineto (under torch.profiler, which memplan uses to measure memory) prints "USDT: ...
    # profiler_start/stop" lines on stderr unless its log level is above all its severities;
    # it reads the level once, when the profiler first starts (see memplan.torch.measure)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    try:
        app(standalone_mode=False)
    except MemplanError as err:
        print(f"memplan: error: {err}", file=sys.stderr)
        sys.exit(2)
    except (typer.Exit, SystemExit) as exit_:
        sys.exit(getattr(exit_, "exit_code", getattr(exit_, "code", 0)))
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as err:
        # usage errors (typer's vendored click) carry show() and exit_code
        if hasattr(err, "show") and hasattr(err, "exit_code"):
            err.show()
            sys.exit(err.exit_code)
        if type(err).__name__ == "Abort":
            sys.exit(130)
        raise


if __name__ == "__main__":  # python -m memplan.cli
    main()
