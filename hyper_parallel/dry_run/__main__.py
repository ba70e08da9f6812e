"""``python -m hyper_parallel.dry_run``: exit 2 on a config/layout error, 1 when the layout does not fit."""

from hyper_parallel.config.manager import run_cli
from hyper_parallel.dry_run import main


def _cli() -> None:
    if main().fits is False:
        raise SystemExit(1)


if __name__ == "__main__":
    run_cli(_cli)
