"""Compatibility entry point: ``python -m server.cli`` and an old ``kvserve = server.cli:main``
console script run ``kvserve.cli`` (the CLI sits above server/; nothing in server imports it)."""
from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from kvserve.cli import main as kvserve_main

    return kvserve_main(argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
