"""What ``bench``, ``train`` and the tests share, not the optimizer (the ``cli`` extra):
model presets (``models``), laying a model out over processes (``parallel``), the command
line's formatting and checks (``cli_support``), and spawned processes (``processes``)."""
