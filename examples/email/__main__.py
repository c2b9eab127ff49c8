"""Drive the email example from a shell (a worker must be running; see README.md).

python -m examples.email send 42 alice@example.com --times 3       # three calls: one email
python -m examples.email redeliver 43 bob@example.com --times 3    # one message, delivered 3 times
python -m examples.email outbox                                    # what was "sent"
"""

from __future__ import annotations

import argparse
import uuid

from .tasks import SEND_RECEIPT, Config, make_celery, open_outbox


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.email")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in [
        ("send", "call send_receipt N times, as a retrying client would"),
        ("redeliver", "publish one message N times by name with plain Celery, as a broker redelivers it"),
    ]:
        command = commands.add_parser(name, help=text)
        command.add_argument("order_id")
        command.add_argument("to")
        command.add_argument("--times", type=int, default=2)
    commands.add_parser("outbox", help="list the outbox")
    args = parser.parse_args(argv)
    config = Config.from_env()

    if args.command == "outbox":
        outbox = open_outbox(config.outbox)
        for key, message in sorted(outbox.items()):
            print(f"{key}  {message['Message-ID']}  to={message['To']}  {message['Subject']}")
        print(f"{len(outbox)} message(s) in {config.outbox}")
        return

    app = make_celery(config)
    if args.command == "send":
        results = [app.tasks[SEND_RECEIPT].delay(args.order_id, args.to) for _ in range(args.times)]
        for result in results:
            print(f"task {result.id} deduplicated={result.deduplicated}")
    else:
        # send_task bypasses the producer-side check: every copy of the message (one task id, as a
        # broker redelivers it) reaches the worker, which runs the body for the first one only.
        task_id = str(uuid.uuid4())
        results = [app.send_task(SEND_RECEIPT, (args.order_id, args.to), task_id=task_id) for _ in range(args.times)]
        print(f"message {task_id} published {args.times} times")
    print(f"outcome: {results[0].get(timeout=30)}")


if __name__ == "__main__":
    main()
