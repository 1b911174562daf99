"""Subcommands of ``crosstalk``: one module each.

A command module defines ``add_arguments(parser)`` and ``main(args) -> int`` (the exit
status), and is listed with its one-line help in ``proxy.cli.COMMANDS``. Only the module
of the command being run is imported, so a command's heavy dependencies never slow down
or break the others.
"""
