"""``python -m loadtest.peers``: the peer bench (``loadtest.peers.cli``)."""

from __future__ import annotations

from loadtest.peers.cli import main

if __name__ == "__main__":
    main()
