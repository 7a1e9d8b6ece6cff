"""The pdserve command line: the commands (`main.py`) and their flags by group (`parser.py` and
the `*_args.py` modules beside it). `python -m pdserve.cli` and the `pdserve` script run
`main.main`; importing a flag module loads nothing else of the CLI."""
