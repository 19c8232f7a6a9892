"""The `mossvox` command line, beside the API: a table of subcommands, one module each."""
