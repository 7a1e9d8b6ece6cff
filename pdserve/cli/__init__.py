"""The pdserve command line: the parser by command group (`parser.py` and the `*_args.py`
flag modules beside it) and the commands (`main.py`). `python -m pdserve.cli` runs it."""

from pdserve.cli.main import main

__all__ = ["main"]
