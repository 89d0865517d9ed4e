"""``python -m shardmuon`` runs the command line (same as the ``shardmuon`` script)."""

from shardmuon.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
