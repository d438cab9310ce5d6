"""The `adloco-node` console script: `adloco-node ctl ...` talks to a running node, `adloco-node
tokenizer ...`, `adloco-node export ...` (node/cli/tools.py) and `adloco-node credential ...`
(node/cli/credential.py) are offline tools; anything else runs a node.

`ctl` is what the Docker HEALTHCHECK calls every 30 s, so it must answer without loading torch,
transformers and hivemind, which the node's own modules import: this module picks one of them
before importing any.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ctl"]:
        # Imported here, not at the top: importing the node would load torch first (seconds).
        from ..operations.ctl import ctl_main

        return ctl_main(argv[1:])
    if argv[:1] == ["credential"]:
        from .credential import credential_main

        return credential_main(argv[1:])
    if argv[:1] in (["tokenizer"], ["export"]):
        from .tools import export_main, tokenizer_main

        return (tokenizer_main if argv[0] == "tokenizer" else export_main)(argv[1:])
    from .node import main as node_main

    return node_main(argv)


if __name__ == "__main__":
    sys.exit(main())
