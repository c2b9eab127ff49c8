"""Run celery_idem.contrib.django's tests on the oldest Django we declare (4.2 LTS).

    python3 tests/contrib_django/versions.py                 # the floor of the `django` extra
    python3 tests/contrib_django/versions.py --django 5.2.19 # another version

The project's own ``.venv`` runs them on the newest (the suite). This builds a virtualenv under
``.cache/django-compat/<version>/`` with that Django, the test tools and this repository
(editable), keeps it, and runs ``pytest tests/contrib_django`` in it; a second run installs nothing.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "django-compat"


def floor() -> str:
    """The lowest Django the `django` extra allows (pyproject.toml: django>=X)."""
    found = re.search(r'django = \["django>=([0-9.]+)', (REPO / "pyproject.toml").read_text())
    if not found:
        raise SystemExit("pyproject.toml has no `django` extra with a django>= floor")
    return found.group(1)


def environment(version: str) -> Path:
    home = CACHE / version
    python = home / "bin" / "python"
    marker = home / ".installed"
    pin = f"django=={version}" if version.count(".") == 2 else f"django~={version}.0"
    # The test tools, and PyMySQL for the tests' MariaDB database
    # django-celery-outbox: the interop test (test_django_celery_outbox.py) runs on this Django too
    wanted = [
        pin,
        "pytest>=8",
        "pytest-timeout>=2.2",
        "hypothesis>=6.90",
        "pymysql>=1.1",
        "django-celery-outbox==0.4.3",
    ]
    if not marker.exists() or marker.read_text() != " ".join(wanted):
        venv.create(home, with_pip=True, clear=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "-e", f"{REPO}[redis,sql]", *wanted], check=True)
        marker.write_text(" ".join(wanted))
    return python


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--django", default=floor(), help="the Django version (default: the extra's floor)")
    args, pytest_args = parser.parse_known_args()
    python = environment(args.django)
    shown = subprocess.run([python, "-c", "import django; print(django.get_version())"], capture_output=True, text=True)
    print(f"== Django {shown.stdout.strip()}: pytest tests/contrib_django", flush=True)
    command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/contrib_django", *pytest_args]
    return subprocess.run(command, cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
