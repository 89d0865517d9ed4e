"""``python -m shardmuon.train``: the ``shardmuon train`` command on its own."""

from shardmuon.train.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
