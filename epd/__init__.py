"""The application on top of the roles: the `epd` command line (cli.py), `epd up` (launcher.py),
the `epd generate` client (client.py) and the benchmarks (bench/)."""
