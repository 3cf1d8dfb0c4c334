"""``kvroute demo``: the README's first command.

Until the simulated fleet and the router land, it shows what the installed kvroute can
already do on this machine: it hashes a sample prompt exactly as vLLM would and prints the
blocks, so a fresh install is checked end to end.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvroute.core.hashing import BlockHasher

HELP = "Run kvroute on the embedded default (a simulated fleet) and print what it shows."


def demo() -> None:
    """Print what this build of kvroute can do, using the embedded default inputs."""
    console = Console()
    hasher = BlockHasher(algo="sha256", block_size=16)
    tokens = list(range(1, 41))
    blocks = hasher.hash_blocks(tokens)
    table = Table(title="vLLM block hashes for tokens 1..40 (block size 16, sha256)")
    table.add_column("block")
    table.add_column("digest (hex)")
    table.add_column("wire (64-bit)")
    for index, block in enumerate(blocks):
        table.add_row(str(index), block.hex(), str(int.from_bytes(block[-8:], "big")))
    console.print(table)
