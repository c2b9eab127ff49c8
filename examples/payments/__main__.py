"""``python -m examples.payments initdb``: create the payments and ledger tables."""

from __future__ import annotations

import argparse

from .config import Config
from .tasks import init_db


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.payments")
    parser.add_argument("command", choices=["initdb"], help="initdb: create the tables if they are missing")
    parser.parse_args(argv)
    config = Config.from_env()
    init_db(config)
    print(f"tables {config.payments_table!r} and {config.ledger_table!r} are ready")


if __name__ == "__main__":
    main()
