"""``python -m spotguard``: the same command line as the ``spotguard`` script."""

from spotguard.cli import main

main()
