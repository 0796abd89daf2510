"""`python -m nanoandrea ...`: the same as the `nanoandrea` command."""
from .cli import main

main(prog_name="nanoandrea")
