"""`CLIError`: a user mistake on the command line, printed by `server.cli.main` as one line
`dialspec: error: ...` with exit status 2, never a traceback. Subcommand modules raise it."""


class CLIError(Exception):
    """A user mistake: the message says what was wrong and how to fix it."""
