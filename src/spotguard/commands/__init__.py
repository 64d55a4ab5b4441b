"""One module per command group of the ``spotguard`` CLI (see :data:`spotguard.cli.COMMANDS`)."""
