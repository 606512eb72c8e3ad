//! Command-line interface: flag parsing and the subcommands.
